{{/* vim: set filetype=mustache: */}}

{{/* Chart name, truncated to a DNS label. */}}
{{- define "kvroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-qualified name; object names add a suffix, so keep room for it (40). */}}
{{- define "kvroute.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvroute.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "kvroute.labels" -}}
helm.sh/chart: {{ include "kvroute.chart" . }}
{{ include "kvroute.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvroute
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "kvroute.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Per-component labels: (list $ "gateway") or (list $ "worker" $pool). */}}
{{- define "kvroute.componentLabels" -}}
{{- $root := index . 0 -}}
{{ include "kvroute.labels" $root }}
app.kubernetes.io/component: {{ index . 1 }}
{{- if gt (len .) 2 }}
kvroute.io/pool: {{ (index . 2).name }}
{{- end }}
{{- end -}}

{{- define "kvroute.componentSelectorLabels" -}}
{{- $root := index . 0 -}}
{{ include "kvroute.selectorLabels" $root }}
app.kubernetes.io/component: {{ index . 1 }}
{{- if gt (len .) 2 }}
kvroute.io/pool: {{ (index . 2).name }}
{{- end }}
{{- end -}}

{{- define "kvroute.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvroute.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The kvroute image reference. */}}
{{- define "kvroute.image" -}}
{{- $img := .Values.image -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $img.repository $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository (default .Chart.AppVersion $img.tag) -}}
{{- end -}}
{{- end -}}

{{/* ---- pools -------------------------------------------------------------------------- */}}

{{/*
A deep merge of two maps as JSON: the second wins, nested maps merge, lists and scalars
(including false, 0 and "") replace. Used to lay each pool over poolDefaults.
*/}}
{{- define "kvroute.deepMerge" -}}
{{- $out := deepCopy (index . 0) -}}
{{- range $k, $v := index . 1 -}}
{{- if and (kindIs "map" $v) (kindIs "map" (get $out $k)) -}}
{{- $_ := set $out $k (include "kvroute.deepMerge" (list (get $out $k) $v) | fromJson) -}}
{{- else if not (kindIs "invalid" $v) -}}
{{- $_ := set $out $k $v -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* Every pool with poolDefaults applied, as JSON {"pools": [...]}. */}}
{{- define "kvroute.pools" -}}
{{- $pools := list -}}
{{- $names := dict -}}
{{- range $i, $p := .Values.pools -}}
{{- $m := include "kvroute.deepMerge" (list $.Values.poolDefaults $p) | fromJson -}}
{{- if hasKey $names $m.name -}}
{{- fail (printf "pools[%d]: the pool name %q is used twice" $i $m.name) -}}
{{- end -}}
{{- $_ := set $names $m.name true -}}
{{- $pools = append $pools $m -}}
{{- end -}}
{{- toJson (dict "pools" $pools) -}}
{{- end -}}

{{- define "kvroute.poolFullname" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "kvroute.fullname" $root) (index . 1).name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Where the gateway finds a pool's tokenizer (a directory or a tokenizer.json). */}}
{{- define "kvroute.tokenizerPath" -}}
{{- $root := index . 0 -}}
{{- $pool := index . 1 -}}
{{- $tk := $root.Values.gateway.tokenizers -}}
{{- $path := $pool.tokenizer.path | default "" -}}
{{- if eq $tk.mode "download" -}}
{{- printf "%s/%s" $tk.mountPath $pool.name -}}
{{- else if not $path -}}
{{- printf "%s/%s" $tk.mountPath $pool.name -}}
{{- else if hasPrefix "/" $path -}}
{{- $path -}}
{{- else -}}
{{- printf "%s/%s" $tk.mountPath $path -}}
{{- end -}}
{{- end -}}

{{/* Engine image of a worker pool. */}}
{{- define "kvroute.engineImage" -}}
{{- $w := .workers -}}
{{- $defaults := dict "vllm" (dict "repository" "vllm/vllm-openai" "tag" "v0.33.0") "sglang" (dict "repository" "lmsysorg/sglang" "tag" "v0.5.23") -}}
{{- $d := get $defaults $w.engine -}}
{{- $repo := $w.image.repository | default $d.repository -}}
{{- $tag := $w.image.tag | default $d.tag -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{/* ---- secrets ------------------------------------------------------------------------ */}}

{{- define "kvroute.secretName" -}}
{{- printf "%s-secrets" (include "kvroute.fullname" .) -}}
{{- end -}}

{{- define "kvroute.redisSecretName" -}}
{{- printf "%s-redis" (include "kvroute.fullname" .) -}}
{{- end -}}

{{/*
Fail the render, naming the value, when a secret that several components must share is
neither given inline nor referenced. Under `helm template` (Argo CD, Flux) the chart cannot
look up what a previous install generated, so it never generates one.
*/}}
{{- define "kvroute.requiredSecrets" -}}
{{- if not (or .Values.index.hashSeed .Values.index.hashSeedSecretRef) -}}
{{- fail "index.hashSeed or index.hashSeedSecretRef is required: the gateways and every agent must share one block-key seed, and the chart never generates one (each render would make a new seed). Create a Secret (kubectl create secret generic kvroute-index --from-literal=seed=$(openssl rand -hex 32)) and set index.hashSeedSecretRef={name: kvroute-index, key: seed}" -}}
{{- end -}}
{{- if and (eq .Values.redis.mode "bundled") (not (or .Values.redis.bundled.password .Values.redis.bundled.passwordSecretRef)) -}}
{{- fail "redis.bundled.password or redis.bundled.passwordSecretRef is required: Redis, the gateways and every agent must share one password, and the chart never generates one (each render would make a new password). Create a Secret (kubectl create secret generic kvroute-redis --from-literal=password=$(openssl rand -hex 24)) and set redis.bundled.passwordSecretRef={name: kvroute-redis, key: password}" -}}
{{- end -}}
{{- end -}}

{{/*
The identity of a shared secret for pod checksum annotations: its inline value, or the
reference plus secretsRevision (a Secret the chart only references changes without the
chart seeing it: bump secretsRevision when you rotate it). Args: (list $ inline ref).
*/}}
{{- define "kvroute.secretIdentity" -}}
{{- $root := index . 0 -}}
{{- toJson (dict "value" (index . 1) "ref" (index . 2) "revision" ($root.Values.secretsRevision | default "")) -}}
{{- end -}}

{{/* What the worker pods (agents) consume: the hash seed and the Redis password. */}}
{{- define "kvroute.sharedSecretsChecksum" -}}
{{- $seed := include "kvroute.secretIdentity" (list . .Values.index.hashSeed .Values.index.hashSeedSecretRef) -}}
{{- $redis := include "kvroute.redisSecretIdentity" . -}}
{{- printf "%s|%s" $seed $redis | sha256sum -}}
{{- end -}}

{{- define "kvroute.redisSecretIdentity" -}}
{{- if eq .Values.redis.mode "bundled" -}}
{{- include "kvroute.secretIdentity" (list . .Values.redis.bundled.password .Values.redis.bundled.passwordSecretRef) -}}
{{- else -}}
{{- include "kvroute.secretIdentity" (list . .Values.redis.external.password .Values.redis.external.passwordSecretRef) -}}
{{- end -}}
{{- end -}}

{{/* Everything the gateway consumes: the chart's Secrets, every reference, the revision. */}}
{{- define "kvroute.gatewaySecretsChecksum" -}}
{{- $refs := dict "seed" .Values.index.hashSeedSecretRef "admin" .Values.auth.adminKeySecretRef "apiKeys" .Values.auth.apiKeys -}}
{{- printf "%s|%s|%s" (include "kvroute.sharedSecretsChecksum" .) (toJson $refs) (.Values.secretsRevision | default "") | cat (include (print .Template.BasePath "/secrets.yaml") .) | sha256sum -}}
{{- end -}}

{{/* secretKeyRef of the hash seed. */}}
{{- define "kvroute.hashSeedRef" -}}
{{- with .Values.index.hashSeedSecretRef -}}
name: {{ .name }}
key: {{ .key }}
{{- else -}}
name: {{ include "kvroute.secretName" . }}
key: hash-seed
{{- end -}}
{{- end -}}

{{/* Whether Redis needs a password, and the secretKeyRef holding it. */}}
{{- define "kvroute.redisHasPassword" -}}
{{- if eq .Values.redis.mode "bundled" -}}
true
{{- else if or .Values.redis.external.password .Values.redis.external.passwordSecretRef -}}
true
{{- end -}}
{{- end -}}

{{- define "kvroute.redisPasswordRef" -}}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.passwordSecretRef -}}
name: {{ .Values.redis.external.passwordSecretRef.name }}
key: {{ .Values.redis.external.passwordSecretRef.key }}
{{- else if and (eq .Values.redis.mode "bundled") .Values.redis.bundled.passwordSecretRef -}}
name: {{ .Values.redis.bundled.passwordSecretRef.name }}
key: {{ .Values.redis.bundled.passwordSecretRef.key }}
{{- else -}}
name: {{ include "kvroute.redisSecretName" . }}
key: password
{{- end -}}
{{- end -}}

{{/* ---- Redis URLs --------------------------------------------------------------------- */}}

{{/* The Redis URL without credentials. */}}
{{- define "kvroute.redisBaseURL" -}}
{{- if eq .Values.redis.mode "bundled" -}}
{{- printf "redis://%s-redis:%d/0" (include "kvroute.fullname" .) (int .Values.redis.bundled.port) -}}
{{- else -}}
{{- required "redis.external.url is required when redis.mode is external" .Values.redis.external.url -}}
{{- end -}}
{{- end -}}

{{- define "kvroute.redisTLSCA" -}}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.tlsCASecretRef -}}
true
{{- end -}}
{{- end -}}

{{- define "kvroute.redisCAPath" -}}
/etc/kvroute/redis-ca/ca.crt
{{- end -}}

{{/*
The gateway's Redis URL, with the password as a $(REDIS_PASSWORD) reference that Kubernetes
expands from the container's environment (the gateway takes AUTH from the URL).
*/}}
{{/* The gateway's Redis URL (the password comes from KVROUTE_REDIS__PASSWORD). */}}
{{- define "kvroute.gatewayRedisURL" -}}
{{- $url := include "kvroute.redisBaseURL" . -}}
{{- $user := "" -}}
{{- if eq .Values.redis.mode "external" -}}
{{- $user = .Values.redis.external.username | default "" -}}
{{- end -}}
{{- if $user -}}
{{- regexReplaceAll "^(rediss?://)" $url (printf "${1}%s@" $user) -}}
{{- else -}}
{{- $url -}}
{{- end -}}
{{- end -}}

{{/* The agent's Redis URL (the password comes from KVROUTE_AGENT_REDIS__PASSWORD). */}}
{{- define "kvroute.agentRedisURL" -}}
{{- $url := include "kvroute.redisBaseURL" . -}}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.username -}}
{{- $url = regexReplaceAll "^(rediss?://)" $url (printf "${1}%s@" .Values.redis.external.username) -}}
{{- end -}}
{{- if include "kvroute.redisTLSCA" . -}}
{{- $sep := ternary "&" "?" (contains "?" $url) -}}
{{- $url = printf "%s%sssl_ca_certs=%s" $url $sep (include "kvroute.redisCAPath" .) -}}
{{- end -}}
{{- $url -}}
{{- end -}}

{{/* ---- gateway security ---------------------------------------------------------------- */}}

{{- define "kvroute.allowedUpstreams" -}}
{{- $sec := .Values.gateway.security -}}
{{- $allowed := concat ($sec.allowedUpstreams | default list) ($sec.podCIDRs | default list) | uniq -}}
{{- toJson (dict "allowed" $allowed) -}}
{{- end -}}

{{/*
YAML text with exponent-notation numbers given a decimal point: Go writes 1e-06, which PyYAML
(the gateway's loader) reads as a string. Only whole scalar values are touched; a string that
looks like a number is quoted by toYaml, so it never matches.
*/}}
{{- define "kvroute.pyyamlFloats" -}}
{{- regexReplaceAll "(?m)^(\\s*(?:[^\\s#:]+:\\s+|-\\s+)+)(-?[0-9]+)e([-+][0-9]+)$" . "${1}${2}.0e${3}" -}}
{{- end -}}

{{/* The gateway container port Prometheus scrapes: its own when gateway.metricsPort is set. */}}
{{- define "kvroute.gatewayMetricsPortName" -}}
{{- if .Values.gateway.metricsPort -}}metrics{{- else -}}http{{- end -}}
{{- end -}}
