"""deploy/: the Helm chart, the container image, the Grafana dashboard and the alert rules.

The chart is linted and rendered with the project's helm (scripts/install-helm puts a helm v4
binary in .venv/bin), every rendered manifest is validated against the Kubernetes schemas
(kubernetes-validate, offline), bad values must fail the install, and the rendered pieces are
checked against the real code they drive: the gateway's ConfigMap and environment load with
``load_config(GatewayConfig)``, the agent's arguments go through the agent's own parser and
config, the ports the agent reads are the ones the engine publishes on, and every metric the
dashboard and the alerts query is one the gateway or the agent exports.
"""

from __future__ import annotations

import argparse
import base64
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from gateway.config import GatewayConfig
from gateway.contract.settings import ConfigError, load_config
from gateway.main import add_arguments as gateway_add_arguments
from gateway.metrics import GatewayMetrics
from gateway.routing.costmodel import CostParams
from gateway.routing.policy import make_policy, policy_names
from worker_agent.cli import add_arguments as agent_add_arguments
from worker_agent.cli import build_config as agent_build_config
from worker_agent.engines.base import endpoint_for_rank
from worker_agent.metrics import AgentMetrics

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "kvroute"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvroute.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
CI_VALUES = sorted(p.name for p in (CHART / "ci").glob("*-values.yaml"))
RENDERS = ["default", *CI_VALUES]
RELEASE, NAMESPACE = "kv", "inference"
# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
K8S_VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())
# Prometheus Operator CRDs: not in the core Kubernetes schemas; checked structurally instead.
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
# Labels every Prometheus target carries (Prometheus Operator relabelling), besides a metric's own.
TARGET_LABELS = {"namespace", "pod", "instance", "job", "service", "endpoint", "container"}
#: ... and the one the chart's ServiceMonitors add to every target (the up/absent alerts)
COMPONENT_LABEL = "kvroute_component"
#: Series Prometheus itself writes for every target.
PROMETHEUS_SERIES: dict[str, set[str]] = {"up": {COMPONENT_LABEL}}


# -- helm --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    binary = ROOT / ".venv" / "bin" / "helm"
    path = str(binary) if binary.exists() else shutil.which("helm")
    if path is None:
        pytest.fail("helm is missing: run scripts/setup (it calls scripts/install-helm)")
    home = tmp_path_factory.mktemp("helm-home")
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [path, *args], capture_output=True, text=True, env=env, timeout=60, check=False
        )

    yield run


#: The chart's defaults need only the secrets it never generates (the render fails without).
REQUIRED_SECRETS = ["--set", "index.hashSeed=ci-default-seed", "--set", "redis.bundled.password=ci-default-redis"]  # fmt: skip


def values_args(name: str) -> list[str]:
    return REQUIRED_SECRETS if name == "default" else ["-f", str(CHART / "ci" / name)]


@pytest.fixture(scope="module")
def rendered(helm: Any) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for name in RENDERS:
        r = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *values_args(name))
        assert r.returncode == 0, f"helm template ({name}) failed:\n{r.stderr}"
        out[name] = [d for d in yaml.safe_load_all(r.stdout) if d]
    return out


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for d in by_kind(docs, kind):
        if d["metadata"]["name"] == name:
            return d
    raise AssertionError(f"no {kind} {name}")


def container(deploy: dict[str, Any], name: str) -> dict[str, Any]:
    for c in deploy["spec"]["template"]["spec"]["containers"]:
        if c["name"] == name:
            return c
    raise AssertionError(f"no container {name} in {deploy['metadata']['name']}")


def workers(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        d
        for d in by_kind(docs, "Deployment")
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
    ]


# -- Kubernetes semantics the tests need: secrets, downward API, $(VAR) expansion ------------

FAKE_FIELDS = {
    "metadata.name": "kv-kvroute-pool-7d9f-abcde",
    "status.podIP": "10.244.3.17",
    "spec.nodeName": "gpu-node-1",
}


def secret_value(docs: list[dict[str, Any]], name: str, key: str) -> str:
    """A Secret's value: the rendered one, or a stand-in for a Secret the user provides."""
    for s in by_kind(docs, "Secret"):
        if s["metadata"]["name"] == name:
            assert key in s["data"], f"Secret {name} has no key {key}"
            return base64.b64decode(s["data"][key]).decode()
    return f"external-{name}-{key}"


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion ($$ escapes; unknown references stay as they are)."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, value)


def container_env(docs: list[dict[str, Any]], c: dict[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
        elif "secretKeyRef" in e["valueFrom"]:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secret_value(docs, ref["name"], ref["key"])
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = FAKE_FIELDS[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            raise AssertionError(f"unexpected env source {e}")
    return env


def mounted_file(
    docs: list[dict[str, Any]], deploy: dict[str, Any], c: dict[str, Any], path: str
) -> str:
    """The content of ``path`` inside container ``c``, when a ConfigMap volume provides it."""
    volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    for m in c.get("volumeMounts", []):
        prefix = m["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            vol = volumes[m["name"]]
            assert "configMap" in vol, f"{path} is on volume {m['name']}, not a ConfigMap"
            cm = find(docs, "ConfigMap", vol["configMap"]["name"])
            return cm["data"][path[len(prefix) :]]
    raise AssertionError(f"nothing mounted at {path}")


def is_mounted(deploy: dict[str, Any], c: dict[str, Any], path: str) -> bool:
    return any(
        path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
        for m in c.get("volumeMounts", [])
    )


# -- lint and Kubernetes schemas ---------------------------------------------------------------


@pytest.mark.parametrize("values", RENDERS)
def test_helm_lint(helm: Any, values: str) -> None:
    r = helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, *values_args(values))
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("values", RENDERS)
def test_manifests_validate_against_kubernetes_schemas(
    rendered: dict[str, list[dict[str, Any]]], values: str
) -> None:
    docs = rendered[values]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount"} <= kinds
    for doc in docs:
        meta = doc["metadata"]
        assert meta["namespace"] == NAMESPACE, meta["name"]
        labels = meta["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/name"] == "kvroute"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"].startswith("kvroute-")
        if doc["kind"] in CRD_KINDS:
            # Not in kubernetes-validate's core schemas: skipped here on purpose, checked in
            # test_prometheus_operator_objects.
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(str(p) for p in exc.path)
                pytest.fail(f"{doc['kind']}/{meta['name']} ({version}): {path}: {exc.message}")


def test_schema_validation_is_strict() -> None:
    """The negative control: the validator really rejects a misspelt field."""
    bad = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "x"},
        "spec": {"ports": [{"port": 80, "targetPort": "http", "protocoll": "TCP"}]},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("values", RENDERS)
def test_selectors_and_references(rendered: dict[str, list[dict[str, Any]]], values: str) -> None:
    docs = rendered[values]
    deployments = by_kind(docs, "Deployment")
    pod_labels = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in deployments
    }
    for d in deployments:
        sel = d["spec"]["selector"]["matchLabels"]
        assert sel.items() <= pod_labels[d["metadata"]["name"]].items()
        spec = d["spec"]["template"]["spec"]
        volumes = {v["name"] for v in spec.get("volumes", [])}
        for c in spec["containers"] + spec.get("initContainers", []):
            assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes, c["name"]
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                port = c.get(probe, {}).get("httpGet", {}).get("port")
                if isinstance(port, str):
                    assert port in {p["name"] for p in c["ports"]}, (c["name"], probe)
        sa = spec.get("serviceAccountName")
        if sa:
            assert find(docs, "ServiceAccount", sa)

    def selected(selector: dict[str, str]) -> list[dict[str, Any]]:
        return [
            d for d in deployments if selector.items() <= pod_labels[d["metadata"]["name"]].items()
        ]

    for svc in by_kind(docs, "Service"):
        targets = selected(svc["spec"]["selector"])
        assert len(targets) == 1, svc["metadata"]["name"]
        ports = {
            p["name"]
            for c in targets[0]["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", [])
        }
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, (svc["metadata"]["name"], p)
    for pdb in by_kind(docs, "PodDisruptionBudget"):
        assert len(selected(pdb["spec"]["selector"]["matchLabels"])) == 1
    for hpa in by_kind(docs, "HorizontalPodAutoscaler"):
        target = find(docs, "Deployment", hpa["spec"]["scaleTargetRef"]["name"])
        assert "replicas" not in target["spec"], "an HPA-managed Deployment must not set replicas"
        assert container(target, "gateway")["resources"]["requests"]["cpu"]
    for np in by_kind(docs, "NetworkPolicy"):
        (target,) = selected(np["spec"]["podSelector"]["matchLabels"])
        ports = {
            p["name"]
            for c in target["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", [])
        }
        for rule in np["spec"]["ingress"]:
            assert {p["port"] for p in rule["ports"]} <= ports
            for peer in rule.get("from", []):
                if set(peer) == {"podSelector"}:
                    assert selected(peer["podSelector"]["matchLabels"]), peer


def test_prometheus_operator_objects(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["vllm-values.yaml"]
    monitors = by_kind(docs, "ServiceMonitor")
    assert len(monitors) == 2
    for sm in monitors:
        sel = sm["spec"]["selector"]["matchLabels"]
        (svc,) = [
            s for s in by_kind(docs, "Service") if sel.items() <= s["metadata"]["labels"].items()
        ]
        names = {p["name"] for p in svc["spec"]["ports"]}
        for ep in sm["spec"]["endpoints"]:
            assert ep["port"] in names and ep["path"] == "/metrics"
            # every target carries its component (the alerts' up/absent rules select on it)
            (relabel,) = ep["relabelings"]
            assert relabel["targetLabel"] == COMPONENT_LABEL
            assert relabel["replacement"] in {"gateway", "agent", "engine"}
        assert sm["metadata"]["labels"]["release"] == "prometheus"
    (rule,) = by_kind(docs, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(ALERTS.read_text()), (
        "PrometheusRule differs from alerts.yaml"
    )
    dash = find(docs, "ConfigMap", f"{RELEASE}-kvroute-dashboard")
    assert json.loads(dash["data"]["kvroute.json"]) == json.loads(DASHBOARD.read_text())
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"


# -- bad values fail at install time -----------------------------------------------------------

SCHEMA_ERRORS: list[tuple[str, dict[str, Any]]] = [
    ("unknown engine", {"pools": [{"name": "a", "model": "m", "workers": {"engine": "tgi"}}]}),
    ("negative GPUs", {"pools": [{"name": "a", "model": "m", "workers": {"gpus": -1}}]}),
    ("pool name not a DNS label", {"pools": [{"name": "Llama_70B", "model": "m"}]}),
    ("pool without model", {"pools": [{"name": "a"}]}),
    ("no pools", {"pools": []}),
    ("misspelt top-level key", {"gatway": {"replicas": 2}}),
    ("misspelt pool key", {"pools": [{"name": "a", "model": "m", "blocksize": 16}]}),
    ("unknown policy", {"pools": [{"name": "a", "model": "m", "policy": "fastest"}]}),
    ("unknown cost parameter", {"pools": [{"name": "a", "model": "m", "cost": {"prefil_a": 1}}]}),
    ("port out of range", {"poolDefaults": {"workers": {"kvEvents": {"port": 70000}}}}),
    ("string replicas", {"gateway": {"replicas": "two"}}),
    ("external Redis without URL", {"redis": {"mode": "external"}}),
    (
        "Redis URL with credentials",
        {"redis": {"mode": "external", "external": {"url": "redis://:pw@h:6379/0"}}},
    ),
    ("unknown Redis mode", {"redis": {"mode": "sentinel"}}),
    ("hash seed in the gateway config", {"gateway": {"config": {"index": {"hash_seed": "s"}}}}),
    ("API keys in the gateway config", {"gateway": {"config": {"auth": {"admin_key": "k"}}}}),
    (
        "upstream key in the gateway config",
        {"gateway": {"config": {"proxy": {"upstream_api_key": "k"}}}},
    ),
    ("chart-owned gateway setting", {"gateway": {"config": {"server": {"port": 9000}}}}),
    ("unknown gateway setting", {"gateway": {"config": {"proxy": {"retries": 3}}}}),
    ("secretKeyRef without key", {"index": {"hashSeedSecretRef": {"name": "s"}}}),
    ("API key without name", {"auth": {"apiKeys": [{"key": "k"}]}}),
    ("bad tokenizer mode", {"gateway": {"tokenizers": {"mode": "s3"}}}),
    ("bad pod CIDR", {"gateway": {"security": {"podCIDRs": ["10.244.0.0"]}}}),
]

TEMPLATE_ERRORS: list[tuple[str, dict[str, Any], str]] = [
    (
        "overlapping event ports",
        {
            "poolDefaults": {
                "workers": {"dataParallelSize": 2, "kvEvents": {"port": 5557, "replayPort": 5558}}
            },
            "pools": [{"name": "a", "model": "m", "workers": {"gpus": 2}}],
        },
        "overlap",
    ),
    (
        "GPUs not divisible by DP",
        {"pools": [{"name": "a", "model": "m", "workers": {"dataParallelSize": 2, "gpus": 3}}]},
        "multiple",
    ),
    (
        "allow-list without pod CIDRs",
        {"gateway": {"security": {"allowedUpstreams": ["10.0.0.0/8"]}}},
        "podCIDRs",
    ),
    (
        "model served twice",
        {"pools": [{"name": "a", "model": "m"}, {"name": "b", "model": "n", "aliases": ["m"]}]},
        "served by two pools",
    ),
    (
        "pool name twice",
        {"pools": [{"name": "a", "model": "m"}, {"name": "a", "model": "n"}]},
        "used twice",
    ),
    (
        "tokenizer volume missing",
        {"gateway": {"tokenizers": {"mode": "volume"}}},
        "tokenizers.volume",
    ),
    ("API key without a key", {"auth": {"apiKeys": [{"name": "a"}]}}, "set key or secretKeyRef"),
    (
        "grace shorter than the drain",
        {"gateway": {"terminationGracePeriodSeconds": 60}},
        "would kill gateways that are still draining",
    ),
    (
        "drain longer than the grace",
        {"gateway": {"config": {"server": {"shutdown_grace": 300}}}},
        "would kill gateways that are still draining",
    ),
    (
        "CA without rediss://",
        {
            "redis": {
                "mode": "external",
                "external": {
                    "url": "redis://h:6379/0",
                    "tlsCASecretRef": {"name": "ca", "key": "ca.crt"},
                },
            }
        },
        "rediss://",
    ),
]


def render_with(
    helm: Any, tmp_path: Path, values: dict[str, Any]
) -> subprocess.CompletedProcess[str]:
    f = tmp_path / "values.yaml"
    f.write_text(json.dumps(values))  # JSON is YAML, without YAML 1.1's n/no/off booleans
    # with the required secrets, so that the failure is the one the values provoke
    args = ("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *REQUIRED_SECRETS)
    return helm(*args, "-f", str(f))


@pytest.mark.parametrize(("why", "values"), SCHEMA_ERRORS, ids=[w for w, _ in SCHEMA_ERRORS])
def test_bad_values_fail_the_schema(
    helm: Any, tmp_path: Path, why: str, values: dict[str, Any]
) -> None:
    r = render_with(helm, tmp_path, values)
    assert r.returncode != 0, f"{why}: rendered anyway"
    assert "values don't meet the specifications of the schema" in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("why", "values", "message"), TEMPLATE_ERRORS, ids=[w for w, _, _ in TEMPLATE_ERRORS]
)
def test_bad_values_fail_the_chart_checks(
    helm: Any, tmp_path: Path, why: str, values: dict[str, Any], message: str
) -> None:
    r = render_with(helm, tmp_path, values)
    assert r.returncode != 0, f"{why}: rendered anyway"
    assert message in r.stderr, r.stderr


def test_schema_follows_the_code() -> None:
    """values.schema.json lists exactly the settings the gateway's dataclasses have."""
    import dataclasses

    from gateway import config as gc

    schema = json.loads((CHART / "values.schema.json").read_text())
    cfg = schema["properties"]["gateway"]["properties"]["config"]["properties"]
    chart_owned = {
        "server": {"host", "port", "workers", "metrics_port"},
        "proxy": {"upstream_api_key"},
        "index": {"hash_seed"},
        "redis": {"url", "tls_ca_file", "password", "cluster", "sentinels", "sentinel_master"},
    }
    sections = {
        "server": gc.ServerSettings,
        "proxy": gc.ProxySettings,
        "limits": gc.LimitSettings,
        "warmup": gc.WarmupSettings,
        "circuit": gc.CircuitSettings,
        "log": gc.LogSettings,
        "index": gc.IndexSettings,
        "redis": gc.RedisSettings,
    }
    for name, cls in sections.items():
        fields = {f.name for f in dataclasses.fields(cls)} - chart_owned.get(name, set())
        assert set(cfg[name]["properties"]) == fields, name
    pool = schema["definitions"]["pool"]["properties"]
    assert set(pool["cost"]["properties"]) == {f.name for f in dataclasses.fields(CostParams)}
    assert pool["policy"]["enum"] == policy_names()


# -- GitOps: deterministic renders, required shared secrets, rolling on a change --------------


@pytest.mark.parametrize("values", RENDERS)
def test_render_is_identical_twice(helm: Any, values: str) -> None:
    """Argo CD and Flux render with ``helm template`` on every sync: nothing may differ."""
    args = ("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *values_args(values))
    first, second = helm(*args), helm(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout


SECRET_REQUIRED: list[tuple[str, list[str], str]] = [
    ("no hash seed", [], "index.hashSeed or index.hashSeedSecretRef is required"),
    (
        "no bundled Redis password",
        ["--set", "index.hashSeed=s"],
        "redis.bundled.password or redis.bundled.passwordSecretRef is required",
    ),
]


@pytest.mark.parametrize(
    ("why", "args", "message"), SECRET_REQUIRED, ids=[w for w, _, _ in SECRET_REQUIRED]
)
def test_shared_secrets_are_required_never_generated(
    helm: Any, why: str, args: list[str], message: str
) -> None:
    r = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)
    assert r.returncode != 0, f"{why}: rendered anyway"
    assert message in r.stderr, r.stderr
    assert "never generates" in r.stderr  # the message says why, not only what


def test_shared_secrets_by_reference_only(helm: Any) -> None:
    """Both shared secrets from Secrets the user owns: the chart stores neither."""
    r = helm(
        "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
        "--set", "index.hashSeedSecretRef.name=idx", "--set", "index.hashSeedSecretRef.key=seed",
        "--set", "redis.bundled.passwordSecretRef.name=rds",
        "--set", "redis.bundled.passwordSecretRef.key=pw",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    assert not by_kind(docs, "Secret")
    _, gw = gateway_parts(docs)
    env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in gw["env"]}
    assert env["KVROUTE_INDEX__HASH_SEED"] == {"name": "idx", "key": "seed"}
    assert env["KVROUTE_REDIS__PASSWORD"] == {"name": "rds", "key": "pw"}
    redis = find(docs, "Deployment", f"{RELEASE}-kvroute-redis")
    (rc,) = redis["spec"]["template"]["spec"]["containers"]
    assert rc["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "rds", "key": "pw"}


def _checksums(helm: Any, *args: str) -> dict[str, str]:
    """Each Deployment's pod-template checksum annotations, joined: what rolls its pods."""
    r = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)
    assert r.returncode == 0, r.stderr
    out = {}
    for d in by_kind([d for d in yaml.safe_load_all(r.stdout) if d], "Deployment"):
        ann = d["spec"]["template"]["metadata"].get("annotations", {})
        sums = sorted(
            f"{k}={v}"
            for k, v in ann.items()
            if k.startswith("checksum/secret") or k == "checksum/password"
        )
        out[d["metadata"]["labels"]["app.kubernetes.io/component"]] = " ".join(sums)
    return out


def test_a_secret_change_rolls_every_consumer(helm: Any) -> None:
    base = ["--set", "index.hashSeed=seed-1", "--set", "redis.bundled.password=pw-1"]
    before = _checksums(helm, *base)
    assert set(before) == {"gateway", "worker", "redis"} and all(before.values())

    def changed(*extra: str) -> set[str]:
        after = _checksums(helm, *base, *extra)
        return {c for c in before if after[c] != before[c]}

    # the seed: gateways and agents (worker pods); Redis does not use it
    assert changed("--set", "index.hashSeed=seed-2") == {"gateway", "worker"}
    # the Redis password: every one of them
    assert changed("--set", "redis.bundled.password=pw-2") == {"gateway", "worker", "redis"}
    # a client key is the gateway's alone: GPU pods are not restarted for it
    assert changed("--set", "auth.adminKey=admin-2") == {"gateway"}
    # Secrets the chart only references: a secretsRevision bump rolls every consumer
    refs = [
        "--set", "index.hashSeedSecretRef.name=idx", "--set", "index.hashSeedSecretRef.key=seed",
        "--set", "redis.bundled.passwordSecretRef.name=rds",
        "--set", "redis.bundled.passwordSecretRef.key=pw",
    ]  # fmt: skip
    ref_before = _checksums(helm, *refs)
    ref_after = _checksums(helm, *refs, "--set", "secretsRevision=rotated-1")
    assert {c for c in ref_before if ref_after[c] != ref_before[c]} == {
        "gateway",
        "worker",
        "redis",
    }


# -- no secrets outside Secrets ----------------------------------------------------------------

KNOWN_SECRETS = {
    "vllm-values.yaml": ["ci-seed-0123", "sk-ci-team-a-key", "ci-admin-key"],
    "bundled-redis-values.yaml": ["ci-bundled-redis-password"],
}


@pytest.mark.parametrize("values", RENDERS)
def test_secrets_only_in_secrets(rendered: dict[str, list[dict[str, Any]]], values: str) -> None:
    docs = rendered[values]
    secrets = list(KNOWN_SECRETS.get(values, []))
    for s in by_kind(docs, "Secret"):
        secrets += [base64.b64decode(v).decode() for v in s.get("data", {}).values()]
    if values not in ("external-redis-tls-values.yaml", "sglang-values.yaml"):  # all referenced
        assert secrets, "a Redis password or a hash seed is in a Secret"
    for doc in docs:
        if doc["kind"] == "Secret":
            continue
        text = yaml.safe_dump(doc)
        for secret in secrets:
            assert secret not in text, (
                f"a secret value appears in {doc['kind']}/{doc['metadata']['name']}"
            )
    for s in KNOWN_SECRETS.get(values, []):
        assert any(
            s in base64.b64decode(v).decode()
            for d in by_kind(docs, "Secret")
            for v in d["data"].values()
        ), f"{s} is not in any Secret"


# -- the gateway's configuration ---------------------------------------------------------------


def gateway_parts(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    deploy = find(docs, "Deployment", f"{RELEASE}-kvroute-gateway")
    return deploy, container(deploy, "gateway")


def load_gateway_config(
    docs: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[GatewayConfig, dict[str, str]]:
    """The gateway's configuration as the container builds it: its args, its env, its files."""
    deploy, c = gateway_parts(docs)
    env = container_env(docs, c)
    args = [expand(a, env) for a in c.get("command", []) + c["args"]]
    assert args[0] == "gateway", "the image's entrypoint is kvroute; the gateway is a subcommand"
    parser = argparse.ArgumentParser()
    gateway_add_arguments(parser)
    ns = parser.parse_args(args[1:])
    cfg_file = tmp_path / "gateway.yaml"
    cfg_file.write_text(mounted_file(docs, deploy, c, ns.config))
    ns.config = str(cfg_file)
    for name in [n for n in os.environ if n.startswith("KVROUTE_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    from gateway.main import config_from_args

    cfg = config_from_args(ns)  # load_config(GatewayConfig, file, os.environ, --set) + validate()
    return cfg, env


@pytest.mark.parametrize("values", RENDERS)
def test_gateway_config_loads(
    rendered: dict[str, list[dict[str, Any]]],
    values: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs = rendered[values]
    deploy, c = gateway_parts(docs)
    cfg, env = load_gateway_config(docs, tmp_path, monkeypatch)
    # the ConfigMap alone is a valid file for the gateway's loader (secrets aside)
    if not cfg.auth.api_keys:  # (keys without their key would be incomplete)
        cm_only = load_config(GatewayConfig, file=tmp_path / "gateway.yaml", env={})
        assert cm_only.pools == cfg.pools
    # secrets arrived verbatim through the environment
    seed_ref = next(e for e in c["env"] if e["name"] == "KVROUTE_INDEX__HASH_SEED")["valueFrom"][
        "secretKeyRef"
    ]
    assert cfg.index.hash_seed == secret_value(docs, seed_ref["name"], seed_ref["key"])
    assert cfg.index.hash_seed != "kvroute", "the default seed must never be used"
    for key in cfg.auth.api_keys:
        assert key.key and not key.key.startswith("'")
    if values == "vllm-values.yaml":
        assert cfg.index.hash_seed == "ci-seed-0123"
        assert [k.key for k in cfg.auth.api_keys] == [
            "sk-ci-team-a-key",
            "external-kvroute-client-keys-team-b",
        ]
        assert cfg.auth.api_keys[0].priority == 2 and cfg.auth.api_keys[0].tokens_per_s == 200000
        assert cfg.auth.admin_key == "ci-admin-key"
        assert cfg.pools[0].cost.prefill_a == pytest.approx(1e-6)
        assert cfg.server.workers == 2 and cfg.index.speculative_ttl == 2.5
        # /metrics on a port of its own: declared, in the Service, scraped there, and admitted
        # by the NetworkPolicy from metricsFrom only
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert cfg.server.metrics_port == ports["metrics"] == 9090
        svc = find(docs, "Service", f"{RELEASE}-kvroute-gateway")
        assert {p["name"] for p in svc["spec"]["ports"]} == {"http", "metrics"}
        sm = find(docs, "ServiceMonitor", f"{RELEASE}-kvroute-gateway")
        assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]
        np = find(docs, "NetworkPolicy", f"{RELEASE}-kvroute-gateway")
        rules = {r["ports"][0]["port"]: r["from"] for r in np["spec"]["ingress"]}
        assert rules["metrics"] == [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
        ]
        assert rules["metrics"][0] not in rules["http"]
    else:
        assert cfg.server.metrics_port == 0  # /metrics on the API port
    # Redis: the password from its Secret (never in the URL), the CA file where it is mounted
    url = urlsplit(cfg.redis.url)
    assert url.scheme in ("redis", "rediss") and url.hostname and not url.password
    if "KVROUTE_REDIS__PASSWORD" in env:
        assert cfg.redis.password == env["KVROUTE_REDIS__PASSWORD"] != ""
    if values == "bundled-redis-values.yaml":
        assert cfg.redis.password == "ci-bundled-redis-password"
    if cfg.redis.tls_ca_file:
        assert url.scheme == "rediss" and is_mounted(deploy, c, cfg.redis.tls_ca_file)
    # listening where the probes and the Service look
    assert cfg.server.host == "0.0.0.0"
    assert cfg.server.port == next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
    # tokenizers where a volume provides them (mode none: the image or extraVolumes)
    init = deploy["spec"]["template"]["spec"].get("initContainers", [])
    for pool in cfg.pools:
        if values != "bundled-redis-values.yaml":
            assert is_mounted(deploy, c, pool.tokenizer), pool.tokenizer
        make_policy(pool.policy, **pool.policy_params)
    if init:
        (fetch,) = init
        assert fetch["args"][1] == next(
            m["mountPath"] for m in fetch["volumeMounts"] if m["name"] == "tokenizers"
        )
        fetched = {a.partition("=")[0] for a in fetch["args"][2:]}
        assert {Path(p.tokenizer).name for p in cfg.pools} == fetched
    # chart-run workers register with their pod IP: the allow-list, when in use, admits them
    if cfg.security.allowed_upstreams and workers(docs):
        from gateway.registry import check_upstream_url

        pod_url = f"http://{FAKE_FIELDS['status.podIP']}:8000"
        assert check_upstream_url(pod_url, cfg.security.allowed_upstreams) is None


def test_gateway_rejects_a_broken_configmap(tmp_path: Path) -> None:
    """The loader the test relies on is strict (a negative control)."""
    f = tmp_path / "gateway.yaml"
    f.write_text("pools: [{model: m, tokenizer: /t, blok_size: 16}]\n")
    with pytest.raises(ConfigError):
        load_config(GatewayConfig, file=f, env={})


# -- workers: engine and agent wired together --------------------------------------------------


def engine_flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


@pytest.mark.parametrize("values", RENDERS)
def test_agent_arguments_and_event_ports(
    rendered: dict[str, list[dict[str, Any]]],
    values: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs = rendered[values]
    cfg, gw_env = load_gateway_config(docs, tmp_path, monkeypatch)
    pools = {p.model: p for p in cfg.pools}
    deploys = workers(docs)
    assert deploys, "every render runs at least one worker pool"
    chart_pools = {d["metadata"]["labels"]["kvroute.io/pool"] for d in deploys}
    assert len(chart_pools) == len(deploys)
    for deploy in deploys:
        engine, agent = container(deploy, "engine"), container(deploy, "agent")
        kind = deploy["metadata"]["labels"]["kvroute.io/engine"]
        eargs = engine["args"]
        # the engine: KV events on with the field names of its own KVEventsConfig
        kv = json.loads(engine_flag(eargs, "--kv-events-config") or "{}")
        assert kv["publisher"] == "zmq"
        if kind == "vllm":
            assert engine["command"] == ["vllm", "serve"]
            assert kv["enable_kv_cache_events"] is True
            dp = int(engine_flag(eargs, "--data-parallel-size") or 1)
            tp = int(engine_flag(eargs, "--tensor-parallel-size") or 1)
            engine_block = engine_flag(eargs, "--block-size")
            assert "--enable-prompt-tokens-details" in eargs
        else:
            assert engine["command"] == ["python3", "-m", "sglang.launch_server"]
            assert "enable_kv_cache_events" not in kv, "SGLang's KVEventsConfig has no such field"
            dp = int(engine_flag(eargs, "--dp-size") or 1)
            tp = int(engine_flag(eargs, "--tp-size") or 1)
            engine_block = engine_flag(eargs, "--page-size")
            assert "--enable-metrics" in eargs and "--enable-cache-report" in eargs
        assert set(kv) <= {
            "enable_kv_cache_events",
            "publisher",
            "endpoint",
            "replay_endpoint",
            "buffer_steps",
            "hwm",
            "max_queue_size",
            "topic",
            *(["bind"] if kind == "sglang" else []),  # vLLM's KVEventsConfig has no bind
        }
        # KV events (prompt token ids) stay in the pod: the replay ROUTER (which always binds
        # what it is given) and SGLang's PUB (bind: true) on loopback; vLLM binds its PUB only
        # on a wildcard, so that port is declared and the NetworkPolicy admits nobody to it
        ev = re.fullmatch(r"tcp://(\*|127\.0\.0\.1):(\d+)", kv["endpoint"])
        replay = re.fullmatch(r"tcp://127\.0\.0\.1:(\d+)", kv["replay_endpoint"])
        assert ev and replay, kv
        assert ev.group(1) == ("*" if kind == "vllm" else "127.0.0.1")
        if kind == "sglang":
            assert kv["bind"] is True
        events_port, replay_port = int(ev.group(2)), int(replay.group(1))
        http_port = int(engine_flag(eargs, "--port") or 0)
        gpus = engine["resources"]["limits"]["nvidia.com/gpu"]
        assert gpus == engine["resources"]["requests"]["nvidia.com/gpu"] == tp * dp
        # CPU and memory requested too: the scheduler must not pack engines without them
        assert {"cpu", "memory"} <= set(engine["resources"]["requests"])

        # the agent: through its real parser and configuration
        env = container_env(docs, agent)
        args = [expand(a, env) for a in agent["args"]]
        assert args[0] == "agent"
        parser = argparse.ArgumentParser()
        agent_add_arguments(parser)
        ns = parser.parse_args(args[1:])
        acfg = agent_build_config(ns, env=env)
        assert acfg.engine.kind == kind
        assert acfg.engine.events == f"tcp://127.0.0.1:{events_port}"
        assert acfg.engine.replay == f"tcp://127.0.0.1:{replay_port}"
        assert acfg.engine.topic == kv["topic"]
        assert acfg.engine.dp_size == dp
        assert acfg.engine.block_size == (int(engine_block) if engine_block else None)
        assert urlsplit(acfg.engine.url).port == http_port
        assert urlsplit(acfg.engine.url).hostname == "127.0.0.1"
        # every rank's wildcard-bound port is declared on the engine container (as the agent
        # computes it) and no loopback-bound one is
        declared = {p["containerPort"] for p in engine["ports"]} - {http_port}
        wildcard = {acfg.engine.events} if kind == "vllm" else set()
        for r in range(dp):
            for ep in (acfg.engine.events, acfg.engine.replay):
                assert ep is not None
                port = int(endpoint_for_rank(ep, r).rsplit(":", 1)[1])
                assert (port in declared) == (ep in wildcard), (ep, declared)
        # ... and the NetworkPolicy (on by default) admits nobody to an event port
        if by_kind(docs, "NetworkPolicy"):
            np = find(docs, "NetworkPolicy", deploy["metadata"]["name"])
            admitted = {p["port"] for rule in np["spec"]["ingress"] for p in rule["ports"]}
            assert admitted <= {"http", "agent-metrics"}, admitted
        # identity: pod name and pod IP from the downward API
        assert acfg.worker_id == FAKE_FIELDS["metadata.name"]
        assert acfg.worker_url == f"http://{FAKE_FIELDS['status.podIP']}:{http_port}"
        assert acfg.labels["node"] == FAKE_FIELDS["spec.nodeName"]
        assert acfg.labels["pool"] == deploy["metadata"]["labels"]["kvroute.io/pool"]
        # the gateway knows the model, with the same block size, seed and Redis
        pool = pools[acfg.model]
        assert engine_flag(eargs, "--served-model-name") == acfg.model == pool.model
        assert acfg.block_size == pool.block_size
        assert acfg.hash_seed == cfg.index.hash_seed
        gw_url, agent_url = urlsplit(cfg.redis.url), urlsplit(acfg.redis.url)
        assert (agent_url.scheme, agent_url.hostname, agent_url.port, agent_url.path) == (
            gw_url.scheme,
            gw_url.hostname,
            gw_url.port,
            gw_url.path,
        )
        assert acfg.redis.password == (cfg.redis.password or None)
        assert (agent_url.username or None) == (gw_url.username or None)
        if cfg.redis.tls_ca_file:
            assert f"ssl_ca_certs={cfg.redis.tls_ca_file}" in agent_url.query
            assert is_mounted(deploy, agent, cfg.redis.tls_ca_file)
        context = engine_flag(eargs, "--max-model-len" if kind == "vllm" else "--context-length")
        if context is not None:
            assert int(context) == pool.max_model_len
        # metrics and probes on the declared ports
        assert acfg.metrics_port == next(p["containerPort"] for p in agent["ports"])
        assert {c["name"] for c in deploy["spec"]["template"]["spec"]["containers"]} == {
            "engine",
            "agent",
        }
        assert agent["securityContext"]["runAsNonRoot"] is True
        assert agent["securityContext"]["readOnlyRootFilesystem"] is True
    assert gw_env  # the gateway container had its environment


# -- metrics in the dashboard and the alerts exist ---------------------------------------------

PROMQL_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
    "and", "or", "unless", "offset", "inf", "nan", "atan2",
}  # fmt: skip


def promql_selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names in its matcher) for every metric an expression reads."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"'(?:[^'\\]|\\.)*'", "''", s)
    s = re.sub(r"\[[^\]]*\]", "", s)  # ranges, subqueries
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    out = []
    for m in re.finditer(r"(?<![\w.:$])([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?\s*(\()?", s):
        name, matcher, call = m.group(1), m.group(2), m.group(3)
        if call and not matcher:
            continue  # a function or an aggregation
        if name in PROMQL_KEYWORDS or re.fullmatch(r"\d+[smhdwy]", name):
            continue
        labels = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", matcher or ""))
        out.append((name, labels))
    return out


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", var["query"]["query"], re.S)
            assert m, var
            exprs.append(m.group(1))
    return exprs


def alert_rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def registry_metrics(registry: Any) -> dict[str, set[str]]:
    """Every sample name a registry exports -> its label names (from the collectors themselves)."""
    out: dict[str, set[str]] = {}
    for collector in list(registry._collector_to_names):
        labels = set(getattr(collector, "_labelnames", ()))
        kind = getattr(collector, "_type", "")
        for name in registry._collector_to_names[collector]:
            out[name] = labels | ({"le"} if name.endswith("_bucket") else set())
        if kind == "counter":
            out[collector._name + "_total"] = labels
    return out


@functools.cache
def exported() -> dict[str, set[str]]:
    gm = GatewayMetrics()
    gw = registry_metrics(gm.registry)
    assert gm.names() <= set(gw) | {n for n in gm.names() if n.endswith("_created")}
    return {**gw, **registry_metrics(AgentMetrics().registry), **PROMETHEUS_SERIES}


def test_promql_parser() -> None:
    got = promql_selectors(
        'histogram_quantile(0.99, sum by (le, worker) (rate(kvroute_ttft_seconds_bucket{pool=~"$pool"}[$__rate_interval])))'
        " / ignoring(x) max(up) > bool 1 and on (a) foo:bar offset 5m"
    )
    assert got == [("kvroute_ttft_seconds_bucket", {"pool"}), ("up", set()), ("foo:bar", set())]


def test_dashboard_and_alert_metrics_are_exported() -> None:
    metrics = exported()
    rules = alert_rules()
    recorded = {r["record"] for r in rules if "record" in r}
    used: dict[str, set[str]] = {}
    sources = [("dashboard", e) for e in dashboard_exprs()] + [("alerts", r["expr"]) for r in rules]
    for where, expr in sources:
        selectors = promql_selectors(expr)
        assert selectors, f"{where}: no metric in {expr!r}"
        for name, labels in selectors:
            assert name in metrics or name in recorded, (
                f"{where}: {name} is not exported ({expr!r})"
            )
            if name in metrics:
                assert labels <= metrics[name] | TARGET_LABELS, (
                    f"{where}: {name} has no label {labels - metrics[name]}"
                )
            used.setdefault(name, set()).update(labels)
    # the dashboard covers what issue 7 asks for
    names = set(used)
    for required in (
        "kvroute_delivered_cached_tokens_total",
        "kvroute_delivered_prompt_tokens_total",
        "kvroute_predicted_matched_tokens_total",
        "kvroute_checked_predicted_tokens_total",
        "kvroute_agreed_cached_tokens_total",
        "kvroute_prompt_tokens_total",
        "kvroute_ttft_seconds_bucket",
        "kvroute_requests_total",
        "kvroute_routing_decision_seconds_bucket",
        "kvroute_tokenization_seconds_bucket",
        "kvroute_event_lag_seconds",
        "kvroute_index_blocks",
        "kvroute_worker_kv_usage",
        "kvroute_circuit_state",
        "kvroute_redis_connected",
        "kvroute_agent_redis_connected",
    ):
        assert required in names, required


def test_dashboard_is_generated_and_well_formed() -> None:
    sys.path.insert(0, str(DASHBOARD.parent))
    try:
        import generate  # deploy/grafana/generate.py
    finally:
        sys.path.pop(0)
    assert generate.render() == DASHBOARD.read_text(), "run python deploy/grafana/generate.py"
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24
    titles = " | ".join(p["title"] for p in dash["panels"])
    for wanted in (
        "hit rate per worker",
        "TTFT p50",
        "TTFT p99",
        "routing reason",
        "Routing decision",
        "Tokenization",
        "Event lag",
        "Index blocks",
        "KV cache usage",
        "Circuit state",
        "Redis",
        "Placements shared",
    ):
        assert wanted.lower() in titles.lower(), wanted


def test_alert_rules_are_well_formed() -> None:
    doc = yaml.safe_load(ALERTS.read_text())
    assert set(doc) == {"groups"}
    alerts = [r for r in alert_rules() if "alert" in r]
    names = [r["alert"] for r in alerts]
    assert len(names) == len(set(names))
    for r in alerts:
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"]
        assert re.fullmatch(r"\d+[smh]", r["for"])
        assert r["expr"].count("(") == r["expr"].count(")")
    for wanted in (
        "EventLag",
        "NoHealthyWorkers",
        "HitRateCollapse",
        "RedisUnreachable",
        "Heartbeats",
    ):
        assert any(wanted in n for n in names), wanted


def test_tokenizer_downloads_can_be_cached_on_a_volume(helm: Any, tmp_path: Path) -> None:
    pvc = {"persistentVolumeClaim": {"claimName": "tokenizers"}}
    r = render_with(helm, tmp_path, {"gateway": {"tokenizers": {"download": {"cache": pvc}}}})
    assert r.returncode == 0, r.stderr
    deploy, _ = gateway_parts([d for d in yaml.safe_load_all(r.stdout) if d])
    spec = deploy["spec"]["template"]["spec"]
    (vol,) = [v for v in spec["volumes"] if v["name"] == "tokenizers"]
    assert vol == {"name": "tokenizers", **pvc}
    (init,) = spec["initContainers"]  # still fetched: once per repo@revision (.complete)
    assert any(m["name"] == "tokenizers" for m in init["volumeMounts"])


def test_network_policies_are_on_by_default(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The defaults close the KV event ports and the engines' API to everything but the
    gateway; agent metrics stay scrapable."""
    docs = rendered["default"]
    policies = {np["metadata"]["name"]: np for np in by_kind(docs, "NetworkPolicy")}
    assert {
        f"{RELEASE}-kvroute-gateway",
        f"{RELEASE}-kvroute-qwen",
        f"{RELEASE}-kvroute-redis",
    } <= set(policies)
    rules = policies[f"{RELEASE}-kvroute-qwen"]["spec"]["ingress"]
    by_port = {r["ports"][0]["port"]: r.get("from") for r in rules}
    assert by_port == {
        "http": [{"podSelector": {"matchLabels": {
            "app.kubernetes.io/name": "kvroute", "app.kubernetes.io/instance": RELEASE,
            "app.kubernetes.io/component": "gateway",
        }}}],
        "agent-metrics": None,  # metricsFrom empty: anyone may scrape the agent
    }  # fmt: skip


# -- alert rule unit tests (promtool) ----------------------------------------------------------

ALERT_TESTS = ALERTS.with_name("alerts_test.yaml")


@pytest.fixture(scope="module")
def promtool() -> str:
    binary = ROOT / ".venv" / "bin" / "promtool"
    path = str(binary) if binary.exists() else shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: run scripts/setup (it calls scripts/install-promtool)")
    return path


def run_alert_tests(promtool: str, tmp_path: Path, tests: dict[str, Any]) -> str:
    """``promtool test rules`` on ``tests`` with each expected alert's static description
    taken from alerts.yaml (the test file spells out only the templated summary)."""
    rules = {r["alert"]: r for r in alert_rules() if "alert" in r}
    for case in tests["tests"]:
        for t in case.get("alert_rule_test", []):
            for exp in t.get("exp_alerts") or []:
                description = rules[t["alertname"]]["annotations"]["description"]
                assert "{{" not in description, "descriptions are static text"
                exp.setdefault("exp_annotations", {})["description"] = description
    shutil.copy(ALERTS, tmp_path / "alerts.yaml")
    (tmp_path / "alerts_test.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    r = subprocess.run(
        [promtool, "test", "rules", str(tmp_path / "alerts_test.yaml")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    return "" if r.returncode == 0 else r.stdout + r.stderr


def test_alert_rules_pass_promtool_check(promtool: str) -> None:
    r = subprocess.run(
        [promtool, "check", "rules", str(ALERTS)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr


def test_alert_rule_unit_tests(promtool: str, tmp_path: Path) -> None:
    failures = run_alert_tests(promtool, tmp_path, yaml.safe_load(ALERT_TESTS.read_text()))
    assert not failures, failures


def test_alert_rule_unit_tests_fail_on_a_wrong_expectation(promtool: str, tmp_path: Path) -> None:
    """The negative control: an alert expected that does not fire fails the run."""
    tests = yaml.safe_load(ALERT_TESTS.read_text())
    healthy = next(
        c
        for c in tests["tests"]
        for t in c.get("alert_rule_test", [])
        if t["alertname"] == "KvrouteErrorBudgetBurnFast" and not t["exp_alerts"]
    )
    for t in healthy["alert_rule_test"]:
        if t["alertname"] == "KvrouteErrorBudgetBurnFast":
            t["exp_alerts"] = [
                {"exp_labels": {"severity": "critical", "namespace": "ns", "pool": "p"}}
            ]
    assert "KvrouteErrorBudgetBurnFast" in run_alert_tests(promtool, tmp_path, tests)


def test_alert_unit_tests_cover_the_slo_absent_and_seed_alerts() -> None:
    """Each of these alerts is seen firing in at least one unit test, and the absent ones
    also seen not firing."""
    tests = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in tests:
        for t in case.get("alert_rule_test", []):
            (fired if t.get("exp_alerts") else quiet).add(t["alertname"])
    wanted = {
        "KvrouteGatewayDown", "KvrouteGatewayAbsent", "KvrouteAgentDown", "KvrouteAgentsAbsent",
        "KvrouteErrorBudgetBurnFast", "KvrouteErrorBudgetBurnSlow", "KvrouteTTFTBudgetBurnFast",
        "KvrouteTTFTBudgetBurnSlow", "KvrouteWorkerSeedMismatch", "KvrouteWorkerTokenizerMismatch",
    }  # fmt: skip
    assert wanted <= fired, wanted - fired
    assert {"KvrouteGatewayAbsent", "KvrouteAgentsAbsent", "KvrouteErrorBudgetBurnFast"} <= quiet
    assert wanted <= {r["alert"] for r in alert_rules() if "alert" in r}


def test_install_promtool_is_idempotent() -> None:
    r = subprocess.run(
        [str(ROOT / "scripts" / "install-promtool")],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    v = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "promtool"), "--version"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert v.stdout.startswith("promtool, version 2.")


# -- the image ---------------------------------------------------------------------------------


def test_dockerfile() -> None:
    text = (ROOT / "Dockerfile").read_text()
    lines = re.sub(r"\\\n", " ", text).splitlines()
    ignore = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    ignore = [ln for ln in ignore if ln and not ln.startswith("#")]
    assert ignore[0] == "*", ".dockerignore starts from nothing and lets the sources in"
    allowed = {ln[1:].rstrip("/") for ln in ignore if ln.startswith("!")}
    copies = [ln.split()[1:-1] for ln in lines if ln.startswith("COPY ") and "--from=" not in ln]
    assert copies
    for sources in copies:
        for src in sources:
            assert (ROOT / src).exists(), f"COPY {src}: no such path"
            assert src.rstrip("/") in allowed, f"COPY {src}: excluded by .dockerignore"
    # every package setuptools installs is copied
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    copied = {s.rstrip("/") for sources in copies for s in sources}
    for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert pattern.rstrip("*") in copied
    assert "kvroute" in project["project"]["scripts"]
    assert 'ENTRYPOINT ["kvroute"]' in text
    (user,) = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    uid = int(user.split(":")[0])
    assert uid != 0
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["gateway"]["podSecurityContext"]["runAsUser"] == uid
    assert values["poolDefaults"]["workers"]["agent"]["securityContext"]["runAsUser"] == uid
    # the image runs the Python the tests run on
    version = re.search(r"ARG PYTHON_IMAGE=python:(\d+)\.(\d+)", text)
    assert version, "the base image is an official python image"
    shipped = (int(version.group(1)), int(version.group(2)))
    assert shipped == sys.version_info[:2], f"image Python {shipped}, tests {sys.version_info[:2]}"
    assert project["tool"]["mypy"]["python_version"] == "{}.{}".format(*shipped)
    # dependencies: exactly the locked files, hashes checked
    (install,) = [ln for ln in lines if ln.startswith("RUN ") and "requirements.lock" in ln]
    assert "--require-hashes" in install and "-r requirements.lock" in install
    # the C extensions (the key function, the untracked id tuples): their build script is
    # copied, the build stage has a compiler, and the build fails unless both were built
    # (setuptools treats them as optional)
    assert "setup.py" in copied and "**/*.so" in ignore
    build_stage = text.split("\nFROM ")[1]
    check = 'python -c "import gateway.routing._ckeys, gateway.tokenization._ids"'
    assert "gcc" in build_stage and check in build_stage


def locked() -> dict[str, str]:
    """requirements.lock: normalised name -> pinned version (every entry with a sha256)."""
    text = (ROOT / "requirements.lock").read_text()
    entries = re.findall(
        r"^([A-Za-z0-9_.-]+)==(\S+) \\\n\s+--hash=sha256:([0-9a-f]{64})$", text, re.M
    )
    pins = [ln for ln in text.splitlines() if ln and not ln.startswith((" ", "#"))]
    assert len(entries) == len(pins) > 0, "every pin has a sha256 hash"
    return {re.sub(r"[-_.]+", "-", n).lower(): v for n, v, _ in entries}


def test_lock_file_pins_what_the_tests_run() -> None:
    """Every runtime dependency is locked at a version its specifier allows, and the tests
    run on those very versions (scripts/setup installs the lock as constraints)."""
    import importlib.metadata
    import tomllib

    from packaging.requirements import Requirement

    pins = locked()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for spec in project["project"]["dependencies"]:
        req = Requirement(spec)
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        assert name in pins, (
            f"{req.name} is not in requirements.lock: run scripts/lock-requirements"
        )
        assert req.specifier.contains(pins[name]), f"{name}=={pins[name]} does not satisfy {spec}"
    drift = {}
    for name, version in pins.items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            drift[name] = (version, installed)
    assert not drift, f"tests run other versions than the image ships (lock, installed): {drift}"


# -- the tokenizer download step ---------------------------------------------------------------


class _Hub(http.server.BaseHTTPRequestHandler):
    files: ClassVar[dict[str, bytes]] = {}
    requests: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.requests.append(self.path)
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_fetch_tokenizers(rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    docs = rendered["default"]
    deploy, _ = gateway_parts(docs)
    (init,) = deploy["spec"]["template"]["spec"]["initContainers"]
    assert init["command"][0] == "python"
    script = tmp_path / "fetch_tokenizers.py"
    script.write_text(mounted_file(docs, deploy, init, init["command"][1]))
    _Hub.files = {
        "/org/model/resolve/main/tokenizer.json": b'{"model": {}}',
        "/org/model/resolve/main/tokenizer_config.json": b'{"chat_template": "x"}',
    }
    _Hub.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}"}

    def run(*items: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(script), "--dest", str(tmp_path / "tok"), *items],
            capture_output=True, text=True, env=env, timeout=30, check=False,
        )  # fmt: skip

    try:
        r = run("m=org/model@main")
        assert r.returncode == 0, r.stderr
        out = tmp_path / "tok" / "m"
        assert (out / "tokenizer.json").read_bytes() == b'{"model": {}}'
        assert (out / "tokenizer_config.json").exists()
        assert not (out / "chat_template.jinja").exists()  # optional, 404
        seen = len(_Hub.requests)
        assert run("m=org/model@main").returncode == 0
        assert len(_Hub.requests) == seen, "a complete directory is not fetched again"
        r = run("x=org/missing@main")
        assert r.returncode == 1 and "has no tokenizer.json" in r.stderr
    finally:
        server.shutdown()
        server.server_close()


def test_install_helm_is_idempotent() -> None:
    r = subprocess.run(
        [str(ROOT / "scripts" / "install-helm")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    v = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "helm"), "version", "--short"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert v.stdout.startswith("v4.")


def test_data_parallel_ranks_render_per_rank_flags(helm: Any, tmp_path: Path) -> None:
    """DeepSeek-class SGLang on one 8-GPU node: 8 data-parallel attention ranks; the agent
    is told the ranks (it publishes each as a cache domain of its own)."""
    r = render_with(
        helm,
        tmp_path,
        {
            "pools": [
                {
                    "name": "ds",
                    "model": "deepseek-v3",
                    "workers": {
                        "engine": "sglang",
                        "gpus": 8,
                        "dataParallelSize": 8,
                        "dpAttention": True,
                    },
                }
            ]
        },
    )
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    (sts,) = [d for d in docs if d["kind"] in ("StatefulSet", "Deployment") and "ds" in
              d["metadata"]["name"] and "gateway" not in d["metadata"]["name"]]  # fmt: skip
    containers = {c["name"]: c for c in sts["spec"]["template"]["spec"]["containers"]}
    engine = containers["engine"]["args"]
    assert engine[engine.index("--dp-size") + 1] == "8" and "--enable-dp-attention" in engine
    # SGLang DP attention: --tp is all 8 GPUs, attention split over the 8 ranks within it
    assert engine[engine.index("--tp-size") + 1] == "8"
    agent = containers["agent"]["args"]
    assert agent[agent.index("--dp-size") + 1] == "8"


# -- LoRA adapters -----------------------------------------------------------------------------


def test_lora_adapters_reach_the_engines_and_the_gateway(
    helm: Any,
    rendered: dict[str, list[dict[str, Any]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs = rendered["vllm-values.yaml"]
    cfg, _ = load_gateway_config(docs, tmp_path, monkeypatch)
    assert cfg.pools[0].adapters == ["sql-lora", "support-lora"]
    eargs = container(workers(docs)[0], "engine")["args"]
    i = eargs.index("--lora-modules")
    assert "--enable-lora" in eargs
    assert eargs[i + 1 : i + 3] == [
        "sql-lora=org/llama-3.1-70b-sql-lora",
        "support-lora=/adapters/support",
    ]
    assert (
        engine_flag(eargs, "--max-loras") == "2" and engine_flag(eargs, "--max-lora-rank") == "64"
    )
    for name in RENDERS:  # no adapters configured: no LoRA flags
        if name != "vllm-values.yaml":
            for d in workers(rendered[name]):
                assert "--enable-lora" not in container(d, "engine")["args"]
    sglang = {
        "pools": [
            {
                "name": "ds",
                "model": "deepseek-ai/DeepSeek-V3",
                "lora": {"adapters": [{"name": "a", "path": "/lora/a"}], "maxLoras": 3},
                "workers": {"engine": "sglang"},
            }
        ]
    }
    r = render_with(helm, tmp_path, sglang)
    assert r.returncode == 0, r.stderr
    sdocs = [d for d in yaml.safe_load_all(r.stdout) if d]
    sargs = container(workers(sdocs)[0], "engine")["args"]
    assert engine_flag(sargs, "--lora-paths") == "a=/lora/a"
    assert engine_flag(sargs, "--max-loras-per-batch") == "3"
    bad = {
        "pools": [{"name": "x", "model": "m", "lora": {"adapters": [{"name": "a=b", "path": "p"}]}}]
    }
    assert render_with(helm, tmp_path, bad).returncode != 0


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_disaggregated_pools_render_a_deployment_per_role(
    helm: Any, tmp_path: Path, engine: str
) -> None:
    """A prefill and a decode Deployment per pool, selected apart, the engines started in
    their role with the connector, the agents told their role (and SGLang's bootstrap)."""
    pd = {"enabled": True, "prefillReplicas": 2, "decodeReplicas": 3, "bootstrapPort": 8998}
    r = render_with(
        helm,
        tmp_path,
        {
            "pools": [
                {"name": "ds", "model": "m", "workers": {"engine": engine, "disaggregation": pd}}
            ]
        },
    )
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    deps = {
        d["metadata"]["labels"].get("kvroute.io/role"): d
        for d in docs
        if d["kind"] == "Deployment" and d["metadata"]["labels"].get("kvroute.io/role")
    }
    assert set(deps) == {"prefill", "decode"}
    assert deps["prefill"]["spec"]["replicas"] == 2 and deps["decode"]["spec"]["replicas"] == 3
    for role, dep in deps.items():
        spec = dep["spec"]
        assert spec["selector"]["matchLabels"]["kvroute.io/role"] == role
        assert spec["template"]["metadata"]["labels"]["kvroute.io/role"] == role
        containers = {c["name"]: c for c in spec["template"]["spec"]["containers"]}
        eng, agent = containers["engine"]["args"], containers["agent"]["args"]
        assert agent[agent.index("--role") + 1] == role
        if engine == "vllm":
            conf = json.loads(eng[eng.index("--kv-transfer-config") + 1])
            assert conf == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        else:
            assert eng[eng.index("--disaggregation-mode") + 1] == role
            assert ("--disaggregation-bootstrap-port" in eng) == (role == "prefill")
            assert ("--bootstrap-port" in agent) == (role == "prefill")


# -- Redis Cluster and Sentinel ------------------------------------------------------------------


def _external(**extra: Any) -> dict[str, Any]:
    return {
        "redis": {"mode": "external", "external": {"url": "redis://redis:6379/0", **extra}},
        "pools": [{"name": "p", "model": "m", "workers": {"engine": "vllm"}}],
    }


@pytest.mark.parametrize(
    ("extra", "env", "args"),
    [
        ({"cluster": True}, {"KVROUTE_REDIS__CLUSTER": "true"}, ["--redis-cluster"]),
        (
            {"sentinels": ["s0:26379", "s1:26379"], "sentinelMaster": "kv"},
            {
                "KVROUTE_REDIS__SENTINELS": "s0:26379,s1:26379",
                "KVROUTE_REDIS__SENTINEL_MASTER": "kv",
            },
            ["--redis-sentinels", "s0:26379,s1:26379", "--redis-sentinel-master", "kv"],
        ),
    ],
    ids=["cluster", "sentinel"],
)
def test_external_redis_cluster_and_sentinel_reach_gateway_and_agents(
    helm: Any, tmp_path: Path, extra: dict[str, Any], env: dict[str, str], args: list[str]
) -> None:
    r = render_with(helm, tmp_path, _external(**extra))
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    gw = find(docs, "Deployment", f"{RELEASE}-kvroute-gateway")
    got = {e["name"]: e.get("value") for e in container(gw, "gateway")["env"]}
    assert {k: got.get(k) for k in env} == env
    (pool,) = workers(docs)
    agent_args = container(pool, "agent")["args"]
    at = agent_args.index(args[0])
    assert agent_args[at : at + len(args)] == args
    plain = [d for d in yaml.safe_load_all(render_with(helm, tmp_path, _external()).stdout) if d]
    gw_env = {
        e["name"]
        for e in container(find(plain, "Deployment", gw["metadata"]["name"]), "gateway")["env"]
    }
    assert not gw_env & set(env)  # a single Redis: none of it


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"cluster": True, "sentinels": ["s:1"], "sentinelMaster": "m"}, "exclude each other"),
        ({"sentinels": ["s:1"]}, "sentinelMaster (the primary's name) is required"),
    ],
    ids=["cluster-and-sentinels", "sentinels-without-master"],
)
def test_bad_cluster_or_sentinel_values_fail(
    helm: Any, tmp_path: Path, extra: dict[str, Any], message: str
) -> None:
    r = render_with(helm, tmp_path, _external(**extra))
    assert r.returncode != 0 and message in r.stderr, r.stderr


def test_sentinel_addresses_are_checked_by_the_schema(helm: Any, tmp_path: Path) -> None:
    r = render_with(helm, tmp_path, _external(sentinels=["no-port"], sentinelMaster="m"))
    assert r.returncode != 0
    assert "values don't meet the specifications of the schema" in r.stderr, r.stderr
