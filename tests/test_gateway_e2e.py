"""The gateway end to end: Redis + sim workers + agents + gateway, real processes on loopback,
driven with the official ``openai`` SDK."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from loadtest.faults import failed_attempts
from loadtest.stack import ADMIN_KEY, Stack, StackConfig, wait_for

MODEL = "sim-model"
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
    "sigma",
    "tau",
]


def text(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    cfg = StackConfig(workers=4, speedup=20, log_dir=tmp_path_factory.mktemp("stack"))
    with Stack(cfg) as s:
        yield s


def client(stack: Stack, i: int = 0, **kw: object) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=stack.gateway_urls[i] + "/v1", api_key="none", max_retries=0, **kw
    )  # type: ignore[arg-type]


def post(
    url: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(
        url,
        data=body,
        method="POST",
        headers={"content-type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def get(url: str, token: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


# -- API surface -------------------------------------------------------------------------------


def test_chat_and_completions_streaming_and_not(stack: Stack) -> None:
    c = client(stack)
    msgs = [{"role": "user", "content": text(1, 50)}]
    r = c.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=5)  # type: ignore[arg-type]
    comp = r.parse()
    assert comp.choices[0].message.content and comp.usage and comp.usage.completion_tokens == 5
    assert r.headers["x-kvroute-worker"].startswith("worker-")
    assert (
        int(r.headers["x-kvroute-matched-tokens"]) >= 0
        and "x-kvroute-predicted-ttft-ms" in r.headers
    )
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, stream=True))  # type: ignore[arg-type]
    # the gateway asked the worker for usage but the client did not: no usage chunk reaches it
    assert (
        all(ch.choices for ch in chunks)
        and sum(1 for ch in chunks if ch.choices[0].delta.content) == 6
    )
    with_usage = list(
        c.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )  # type: ignore[arg-type]
    assert with_usage[-1].usage is not None and with_usage[-1].usage.completion_tokens == 3
    cp = c.completions.create(model=MODEL, prompt=text(2, 40), max_tokens=4)
    assert cp.choices[0].text and cp.usage and cp.usage.completion_tokens == 4
    ids = c.completions.create(model=MODEL, prompt=[101, 102, 103] * 20, max_tokens=2)
    assert ids.usage and ids.usage.prompt_tokens == 60
    streamed = list(
        c.completions.create(model=MODEL, prompt=text(3, 30), max_tokens=4, stream=True)
    )
    assert "".join(s.choices[0].text for s in streamed if s.choices)
    models = c.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_a_new_question_under_a_cached_document_is_routed_before_it_is_encoded(
    stack: Stack,
) -> None:
    """Completions whose new text is a small part of the prompt are routed on the document's
    ids while that text is encoded (``tokenize_overlap_chars``): they land on the document's
    holder, the engine counts exactly the ids the gateway does, and a prompt whose exact count
    (not its estimate) is past the context gets the gateway's 400."""
    import tokenizers

    plain = tokenizers.Tokenizer.from_file(stack.tokenizer_path())
    c = client(stack)
    document = text(71, 6000)
    warm = c.completions.with_raw_response.create(
        model=MODEL, prompt=document + " What is alpha?", max_tokens=2
    )
    holder = warm.headers["x-kvroute-worker"]
    for seed, stream in ((72, False), (73, True)):
        prompt = document + " " + text(seed, 150)
        exact = len(plain.encode(prompt).ids)
        if stream:
            chunks = list(
                c.completions.create(
                    model=MODEL,
                    prompt=prompt,
                    max_tokens=3,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices)
            usage = chunks[-1].usage
        else:
            r = c.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=3)
            assert r.headers["x-kvroute-worker"] == holder
            assert int(r.headers["x-kvroute-matched-tokens"]) >= 0.9 * (exact - 300)
            usage = r.parse().usage
        assert usage is not None and usage.prompt_tokens == exact
    _, metrics = get(stack.gateway_urls[0] + "/metrics")
    overlapped = [
        float(line.split()[-1])
        for line in metrics.decode().splitlines()
        if line.startswith("kvroute_tokenization_overlapped_total{")
    ]
    assert sum(overlapped) >= 2  # both were routed before their new text was encoded
    dense = document + " " + " ".join(f"{n}🙂" for n in range(200))
    exact = len(plain.encode(dense).ids)
    body = {"model": MODEL, "prompt": dense, "max_tokens": stack.config.max_model_len - exact + 8}
    got, _, data = post(stack.gateway_urls[0] + "/v1/completions", json.dumps(body).encode())
    err = json.loads(data)["error"]
    assert got == 400 and err["code"] == "context_length_exceeded"
    assert f"({exact} in the messages" in err["message"]


def _socket_inodes(pids: list[int]) -> set[str]:
    """Inodes of the sockets the processes ``pids`` hold open (/proc/<pid>/fd)."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
    return inodes


def _open_tcp_ports_to(port: int, pids: list[int]) -> set[int]:
    """Local ports of the open TCP connections to ``port`` held by ``pids`` (/proc/net/tcp;
    the agent beside the worker scrapes it too, on connections of its own)."""
    mine = _socket_inodes(pids)
    ports = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].split(":")[1], 16) == port and fields[3] == "01" and fields[9] in mine:
            ports.add(int(fields[1].split(":")[1], 16))
    return ports


def test_streams_keep_their_worker_connection_alive(tmp_path: Path) -> None:
    """A stream is relayed to its end and its upstream connection reused: a relay that stopped
    reading at the last event closed the connection (when the body's end had not arrived with
    it), and the next request paid a new one. Each stream's connection is seen while it
    streams: the one the first request opened serves them all, but for one more at most. The
    client has its answer before the relay has read the body's end, so its next request can
    find that connection still draining (seen on a busy machine) and open a second, and on a
    loaded one (CI's parallel tests beside the stack, 2026-12-06) both were once still
    draining when a request started, which opened a third. A relay that closed its
    connections opens one per stream: 20."""
    from urllib.parse import urlsplit

    with Stack(StackConfig(workers=1, speedup=50, log_dir=tmp_path)) as s:
        port = urlsplit(s.worker_urls[0]).port
        assert port is not None
        c = client(s)
        c.completions.create(model=MODEL, prompt=text(90, 20), max_tokens=2)
        pids = s.gateway_pids()
        assert pids
        before = _open_tcp_ports_to(port, pids)
        used: set[int] = set()
        for i in range(20):
            stream = c.completions.create(
                model=MODEL, prompt=text(91 + i, 20), max_tokens=24, stream=True
            )
            pieces = []
            for chunk in stream:
                if not pieces:  # mid-stream: the gateway's connection to the worker is open
                    held = _open_tcp_ports_to(port, pids)
                    assert held, "the gateway holds no connection to the worker mid-stream"
                    used |= held - before
                pieces.extend(ch.text for ch in chunk.choices)
            assert "".join(pieces)
        assert len(used) <= 3, f"{len(used)} new connections for 20 streams"


def _sums(metrics: bytes, *names: str) -> list[float]:
    """Each named counter summed over its labels (``name{...} value`` lines)."""
    lines = metrics.decode().splitlines()
    return [sum(float(x.split()[-1]) for x in lines if x.startswith(n + "{")) for n in names]


def test_multi_turn_follow_ups_land_on_the_prefix_holder_and_hit_the_cache(stack: Stack) -> None:
    """Follow-ups go to their conversation's worker and hit its cache. They are routed on the
    ids the previous turn left (``tokenize_overlap_chats``) and rendered meanwhile: the
    gateway's count of each prompt is still the engine's."""
    counters = ("kvroute_tokenization_overlapped_total", "kvroute_prompt_tokens_total")
    counters += ("kvroute_delivered_prompt_tokens_total",)
    before = _sums(get(stack.gateway_urls[0] + "/metrics")[1], *counters)
    c = client(stack)
    msgs: list[dict[str, str]] = [{"role": "system", "content": text(10, 600)}]
    workers, cached = [], []
    for turn in range(5):
        msgs.append({"role": "user", "content": text(100 + turn, 40)})
        r = c.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=8)  # type: ignore[arg-type]
        comp = r.parse()
        workers.append(r.headers["x-kvroute-worker"])
        assert comp.usage and comp.usage.prompt_tokens_details
        cached.append(
            (comp.usage.prompt_tokens_details.cached_tokens or 0, comp.usage.prompt_tokens)
        )
        msgs.append({"role": "assistant", "content": comp.choices[0].message.content or ""})
    assert len(set(workers)) == 1, workers
    for hit, total in cached[1:]:
        assert hit >= 0.8 * total, cached
    # the gateway's prediction matched what the engine delivered
    _, metrics = get(stack.gateway_urls[0] + "/metrics")
    assert b"kvroute_delivered_cached_tokens_total" in metrics
    overlapped, counted, delivered = (
        a - b for a, b in zip(_sums(metrics, *counters), before, strict=True)
    )
    # the last three follow-ups were routed before their render (the first one's new text,
    # two questions and a reply, is more than tokenize_overlap_fraction of this short chat)
    assert overlapped >= 3
    assert counted == delivered == sum(total for _, total in cached)


def test_errors_are_openai_shaped_4xx(stack: Stack) -> None:
    url = stack.gateway_urls[0]
    cases = [
        (b"{not json", 400, "invalid_json"),
        (b"\xff\xfe", 400, "invalid_utf8"),
        (json.dumps({"model": MODEL}).encode(), 400, "missing_field"),
        (json.dumps({"model": MODEL, "messages": "x"}).encode(), 400, "invalid_type"),
        (
            json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).encode(),
            404,
            "model_not_found",
        ),
        (
            json.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": text(5, 70000)}]}
            ).encode(),
            400,
            "context_length_exceeded",
        ),
        (
            json.dumps(
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 10**9,
                }
            ).encode(),
            400,
            "context_length_exceeded",
        ),
        (
            json.dumps({"model": MODEL, "messages": [{"role": 7, "content": "x"}]}).encode(),
            400,
            "invalid_prompt",
        ),
        (json.dumps({"model": MODEL, "prompt": [10**9]}).encode(), 400, "invalid_token_id"),
    ]
    for body, status, code in cases:
        path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
        got, headers, data = post(url + path, body)
        assert got == status, (body[:80], got, data[:200])
        err = json.loads(data)["error"]
        assert err["code"] == code and err["message"] and "type" in err
        assert headers.get("x-request-id")
    big = b'{"model": "x", "prompt": "' + b"a" * (33 * 1024 * 1024) + b'"}'
    got, _, data = post(url + "/v1/completions", big)
    assert got == 413 and json.loads(data)["error"]["code"] == "request_too_large"
    assert get(url + "/nope")[0] == 404
    # the SDK sees a proper exception, not a crash
    with pytest.raises(openai.NotFoundError):
        client(stack).chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}]
        )


def test_health_ready_metrics_and_admin_endpoints(stack: Stack) -> None:
    url = stack.gateway_urls[0]
    assert get(url + "/health") == (200, b'{"status": "ok"}')
    assert get(url + "/ready")[0] == 200
    status, body = get(url + "/metrics")
    assert status == 200
    for name in (
        b"kvroute_requests_total",
        b"kvroute_ttft_seconds_bucket",
        b"kvroute_index_blocks",
        b"kvroute_redis_connected 1.0",
        b"kvroute_redis_client_rebuilds 0.0",  # one node: no cluster client to replace
    ):
        assert name in body
    # every request so far was routed, and each decision was timed
    count = next(
        line
        for line in body.decode().splitlines()
        if line.startswith("kvroute_routing_decision_seconds_count")
    )
    assert float(count.rsplit(" ", 1)[1]) > 0
    # the KV-event reads, and the entries they brought (at least one each: every routed
    # request's prefill was stored and published)
    values = {
        line.split(" ")[0]: float(line.rsplit(" ", 1)[1])
        for line in body.decode().splitlines()
        if line.startswith("kvroute_event_")
    }
    reads, entries = values["kvroute_event_reads"], values["kvroute_event_entries_read"]
    assert reads > 0 and entries > 0
    assert get(url + "/workers")[0] == 401
    assert get(url + "/workers", "wrong")[0] == 401
    status, body = get(url + "/workers", ADMIN_KEY)
    ws = json.loads(body)["workers"]
    assert status == 200 and {w["worker_id"] for w in ws} == {f"worker-{i}" for i in range(4)}
    assert all(w["healthy"] and w["circuit"] == "closed" for w in ws)
    probe = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": text(1, 50)}]}
    ).encode()
    status, _, body = post(url + "/debug/route", probe, {"authorization": f"Bearer {ADMIN_KEY}"})
    d = json.loads(body)
    assert status == 200 and d["worker"].startswith("worker-") and len(d["candidates"]) == 4
    assert {"worker", "matched_tokens", "predicted_ttft_ms", "score"} <= set(d["candidates"][0])
    assert post(url + "/debug/route", probe)[0] == 401


def test_two_replicas_make_the_same_decisions_for_the_same_index(stack: Stack) -> None:
    stack.start_gateway(1)
    try:
        stack.wait_ready()
        c = client(stack, 0)
        prompts = [text(500 + i, 400) for i in range(6)]
        for p in prompts:  # warm distinct prefixes through replica 0
            c.completions.create(model=MODEL, prompt=p, max_tokens=1)
        probes = [json.dumps({"model": MODEL, "prompt": p + " and more"}).encode() for p in prompts]

        def decisions(url: str) -> list[tuple[str, int]]:
            out = []
            for body in probes:
                _, _, data = post(
                    url + "/debug/route", body, {"authorization": f"Bearer {ADMIN_KEY}"}
                )
                d = json.loads(data)
                out.append((d["worker"], d["matched_tokens"]))
            return out

        deadline = time.monotonic() + 10
        while decisions(stack.gateway_urls[0]) != decisions(stack.gateway_urls[1]):
            assert time.monotonic() < deadline, "replicas did not converge on the same index"
            time.sleep(0.1)
        assert all(m > 0 for _, m in decisions(stack.gateway_urls[1]))
    finally:
        stack.gateways[1].stop()
        stack.gateways.pop()
        stack.gateway_urls.pop()


# -- load and faults (each with its own stack) ---------------------------------------------------


def test_saturated_hot_prefix_holder_loses_traffic_to_idle_workers(tmp_path: Path) -> None:
    with Stack(StackConfig(workers=4, speedup=4, log_dir=tmp_path)) as stack:
        c = client(stack, timeout=60)
        shared = text(7, 1500)

        def one(i: int) -> tuple[str, int, int]:
            r = c.completions.with_raw_response.create(
                model=MODEL, prompt=shared + " " + text(1000 + i, 500), max_tokens=4
            )
            u = r.parse().usage
            assert u is not None and u.prompt_tokens_details is not None
            return (
                r.headers["x-kvroute-worker"],
                u.prompt_tokens_details.cached_tokens or 0,
                u.prompt_tokens,
            )

        one(-1)  # one worker holds the hot prefix
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            results = list(pool.map(one, range(48)))
        used = Counter(w for w, _, _ in results)
        assert len(used) >= 3, used  # the holder alone would queue everything
        hit = sum(h for _, h, _ in results) / sum(t for _, _, t in results)
        assert hit > 0.4, hit  # and the prefix still mostly comes from cache


def retries(stack: Stack, worker: str) -> float:
    _, metrics = get(stack.gateway_urls[0] + "/metrics")
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.decode().splitlines()
        if line.startswith("kvroute_retries_total{") and f'worker="{worker}"' in line
    )


def routes_to(stack: Stack, prompt: str, worker: str) -> bool:
    """Would the gateway send ``prompt`` to ``worker`` now, for a prefix match (dry run)?"""
    body = json.dumps({"model": MODEL, "prompt": prompt}).encode()
    status, _, data = post(
        stack.gateway_urls[0] + "/debug/route", body, {"authorization": f"Bearer {ADMIN_KEY}"}
    )
    d = json.loads(data)
    return status == 200 and d["worker"] == worker and d["matched_tokens"] > 0


@pytest.mark.alone
def test_killed_worker_is_avoided_and_unstarted_requests_are_retried(tmp_path: Path) -> None:
    """R3 with a real process death: the worker holding a prefix is SIGKILLed; follow-ups that
    prefer it are retried elsewhere (no client error), and from 1 s after the death was
    observable (process reaped, port refusing) the gateway makes no attempt on it at all."""
    cfg = StackConfig(workers=3, solo_workers=3, speedup=20, log_dir=tmp_path)
    with Stack(cfg) as stack:
        c = client(stack)
        prompt = text(42, 300)
        first = c.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=2)
        holder = first.headers["x-kvroute-worker"]
        assert wait_for(lambda: routes_to(stack, prompt + " 0", holder), 10) is not None
        dead, dead_wall = stack.kill_worker(int(holder.split("-")[1]))
        # follow-ups prefer the holder (its prefix is indexed) yet must all succeed elsewhere;
        # one after the other for 3 s after the death (at most 300), past the moment its
        # circuit half-opens (2 s)
        seen: list[tuple[float, str]] = []
        while time.monotonic() < dead + 3.0 and len(seen) < 300:
            sent = time.monotonic() - dead
            r = c.completions.with_raw_response.create(
                model=MODEL, prompt=prompt + f" {len(seen)}", max_tokens=2
            )
            assert r.parse().choices[0].text is not None
            seen.append((sent, r.headers["x-kvroute-worker"]))
        assert all(w != holder for _, w in seen), seen
        assert sum(1 for t, _ in seen if t >= 1.0) >= 5, seen  # the 1 s check has substance
        # every attempt on the dead holder, with its time (the gateway's log; the same count
        # as its retry counter): the first follow-up met the refused port and was retried,
        # and none came 1 s or more after the death
        attempts = [t - dead_wall for t in failed_attempts(stack, holder)]
        assert len(attempts) == retries(stack, holder) >= 1, (attempts, retries(stack, holder))
        assert all(t < 1.0 - 0.001 for t in attempts), attempts  # (the log has milliseconds)
        ws = {w["worker_id"]: w for w in stack.workers()}
        assert not ws[holder]["healthy"]


@pytest.mark.alone
def test_idle_worker_death_is_noticed_within_one_second_despite_a_hung_worker(
    tmp_path: Path,
) -> None:
    """R3 when nothing is sent to a worker as it dies: only the gateway's health probe can
    notice, and a request 1 s after the death must not be sent to it, even when another
    worker's /health never answers (the case that delays the probe)."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    rounds_done: list[float] = []  # a probe round ends when it gives up on the hung worker

    def hold(conn: socket.socket) -> None:
        # read the probe's request, never answer, note when the prober gives up
        with conn, contextlib.suppress(OSError):
            while conn.recv(4096):
                pass
        rounds_done.append(time.monotonic())

    def accept() -> None:
        while True:
            try:
                conn, _ = hung.accept()
            except OSError:
                return
            threading.Thread(target=hold, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    hung_url = f"http://127.0.0.1:{hung.getsockname()[1]}"
    cfg = StackConfig(
        workers=3,
        solo_workers=3,
        speedup=20,
        log_dir=tmp_path,
        pool_settings={"static_workers": [{"url": hung_url, "worker_id": "hung"}]},
    )
    try:
        with Stack(cfg) as stack:
            assert (
                wait_for(
                    lambda: not {w["worker_id"]: w for w in stack.workers()}["hung"]["healthy"],
                    10,
                )
                is not None
            ), "the hung worker's probe never failed"
            c = client(stack)
            prompt = text(43, 300)
            first = c.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=2)
            holder = first.headers["x-kvroute-worker"]
            # the follow-up goes to the holder while it lives (its prefix is indexed) ...
            assert wait_for(lambda: routes_to(stack, prompt + " more", holder), 10) is not None
            # ... which dies just after a probe round found every worker alive: the worst moment
            n = len(rounds_done)
            assert wait_for(lambda: len(rounds_done) > n, 5, step=0.005) is not None, "no probe"
            dead, dead_wall = stack.kill_worker(int(holder.split("-")[1]))
            time.sleep(max(0.0, dead + 1.0 - time.monotonic()))  # the 1 s under test
            r = c.completions.with_raw_response.create(
                model=MODEL, prompt=prompt + " more", max_tokens=2
            )
            assert r.headers["x-kvroute-worker"] != holder  # served elsewhere in any case
            attempts = [t - dead_wall for t in failed_attempts(stack, holder)]
            assert len(attempts) == retries(stack, holder), attempts
            assert not [t for t in attempts if t >= 1.0 - 0.001], attempts
    finally:
        hung.close()


def test_redis_killed_and_restarted_mid_run_loses_no_request(tmp_path: Path) -> None:
    with Stack(StackConfig(workers=3, speedup=20, log_dir=tmp_path)) as stack:
        c = client(stack)
        assert stack.redis is not None
        errors: list[BaseException] = []
        done = 0

        def run(i: int) -> None:
            nonlocal done
            try:
                c.completions.create(model=MODEL, prompt=text(i % 5, 200) + f" {i}", max_tokens=3)
                done += 1
            except Exception as exc:  # collected and asserted below
                errors.append(exc)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futs = [pool.submit(run, i) for i in range(20)]
            concurrent.futures.wait(futs)
            stack.redis.kill()
            futs = [pool.submit(run, i) for i in range(20, 60)]
            concurrent.futures.wait(futs)
            stack.redis.start()
            futs = [pool.submit(run, i) for i in range(60, 80)]
            concurrent.futures.wait(futs)
        assert not errors and done == 80
        # after Redis returns the gateway reconnects and resynchronises: agents re-register and
        # the index is rebuilt to equal every agent's mirror (routing never waited for this)
        stack.wait_ready(timeout=30)

        def resynced() -> bool:
            _, body = get(stack.gateway_urls[0] + "/metrics")
            return b"kvroute_redis_connected 1.0" in body and not stack.diverged()

        assert wait_for(resynced, timeout=30) is not None, stack.diverged()


def test_no_healthy_worker_is_503_with_retry_after(tmp_path: Path) -> None:
    with Stack(StackConfig(workers=1, speedup=20, log_dir=tmp_path)) as stack:
        stack.fault(0, "kill")
        deadline = time.monotonic() + 10
        while True:
            status, headers, data = post(
                stack.gateway_urls[0] + "/v1/completions",
                json.dumps({"model": MODEL, "prompt": "hello"}).encode(),
            )
            if status == 503:
                break
            assert status == 502 and time.monotonic() < deadline, (status, data)
        assert headers.get("Retry-After") == "1"
        assert json.loads(data)["error"]["code"] == "no_healthy_worker"
        # ready means "can answer" (this 503), not "has a healthy worker" (issue 15)
        assert get(stack.gateway_urls[0] + "/ready")[0] == 200


def test_api_keys_and_multiprocess_gateway(tmp_path: Path) -> None:
    cfg = StackConfig(
        workers=2,
        speedup=20,
        log_dir=tmp_path,
        gateway_processes=2,
        gateway_settings={"auth": {"api_keys": [{"key": "k1", "name": "team-a"}]}},
    )
    with Stack(cfg) as stack:
        url = stack.gateway_urls[0]
        pids = stack.gateway_pids()
        # two serving processes announced themselves, neither of them the supervisor
        assert len(set(pids)) == 2 and stack.gateways[0].pid not in pids, pids
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=url + "/v1", api_key="k1", max_retries=0).models.list().data
        # Each request on a connection of its own (urllib): the kernel spreads connections, not
        # requests, over the processes on the port. Every process counts the requests it
        # forwards in its own metrics file; both must have served some within 64 requests
        # (all 64 on one process: p = 2**-63 with a fair spread).
        body = json.dumps({"model": MODEL, "prompt": text(3, 20), "max_tokens": 1}).encode()
        per_process: dict[int, float] = {}
        sent = 0
        while sent < 64:
            status, _, data = post(url + "/v1/completions", body, {"authorization": "Bearer k1"})
            assert status == 200, data[:200]
            sent += 1
            if sent % 8 == 0:
                per_process = stack.process_counter("kvroute_requests_total")
                if all(per_process.get(pid, 0) > 0 for pid in pids):
                    break
        assert sorted(per_process) == sorted(pids), per_process
        assert all(n > 0 for n in per_process.values()), (sent, per_process)
        # each request was counted once, by the process that served it; /metrics sums them
        assert sum(per_process.values()) == sent, (sent, per_process)
        _, metrics = get(url + "/metrics")
        aggregated = sum(
            float(x.rsplit(" ", 1)[1])
            for x in metrics.decode().splitlines()
            if x.startswith("kvroute_requests_total{")
        )
        assert aggregated == sent, (aggregated, sent)


def _sse_lines(url: str, max_tokens: int) -> Iterator[tuple[float, bytes]]:
    """(seconds since the send, line) of a streamed chat through ``url``, as they arrive."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text(7, 30)}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
        for line in resp:
            if line.strip():
                yield time.monotonic() - t0, line.strip()


@pytest.mark.alone
def test_stream_idle_timeout_ends_a_stalled_stream_and_spares_a_long_one(tmp_path: Path) -> None:
    """``proxy.idle_timeout`` bounds each wait for the worker's next chunk, not the stream:
    a stream that lasts several timeouts with its tokens closer together arrives whole, and
    one whose worker stops mid-stream ends with an error event one timeout later."""
    idle = 0.5
    cfg = StackConfig(
        workers=1, speedup=2, log_dir=tmp_path, gateway_settings={"proxy": {"idle_timeout": idle}}
    )
    with Stack(cfg) as stack:
        url = stack.gateway_urls[0]
        stack.fault(0, "slow", factor=5)  # ~35 ms a token
        lines = list(_sse_lines(url, 128))
        stack.fault(0, "slow", factor=1)
        last, gaps = lines[-1][0], [b[0] - a[0] for a, b in itertools.pairwise(lines)]
        assert lines[-1][1] == b"data: [DONE]" and b'"error"' not in b"".join(x for _, x in lines)
        assert last > 3 * idle and max(gaps) < idle, (last, max(gaps))

        stream = _sse_lines(url, 400)
        first_at, first = next(stream)
        assert first.startswith(b"data: {") and b'"error"' not in first
        stack.fault(0, "pause")
        try:
            rest = list(stream)
        finally:
            stack.fault(0, "resume")
        end_at = rest[-1][0]
        error = json.loads(rest[-2][1][5:])["error"]
        assert rest[-1][1] == b"data: [DONE]" and error["code"] == "stream_broken"
        assert "failed mid-stream" in error["message"] and "TimeoutError" in error["message"]
        assert idle <= end_at - first_at < idle + 3.0, (first_at, end_at)
        _, metrics = get(url + "/metrics")
        assert b"kvroute_stream_errors_total{" in metrics
