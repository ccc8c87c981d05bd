"""P4's last clause for ``kvroute bench gateway --stall-seconds``: a cold prompt never stalls
the event loop, and a new conversation under a known system prompt pays only for its new text.

**Stall.** Two kvroute gateway processes on the same worker: one as configured (a prompt
whose uncached text reaches ``pools[].tokenize_thread_chars`` is encoded on a worker thread,
``encode_batch`` releasing the GIL), one with ``tokenize_thread_chars: 0`` (every encode on
the event loop). Through each, in alternating phases: short streamed chats (one token) at
``--stall-short-rate``, open-loop Poisson, and cold chats of ``--stall-long-words`` novel
words (nothing of them cached anywhere: about 8,000 tokens of tokenizer CPU each) at
``--stall-long-rate``; a quiet phase (short chats alone) through the offloading gateway is
the baseline. Every short chat has a twin sent at the same moment straight to the worker
(the simulator tokenizes in Python on its own loop, so a long prompt delays the worker's
answers too): the figure is the p99 of the paired differences, routed TTFT - direct TTFT
(client side), beside each path's own p99.

**New conversation under a known system prompt.** In process, on the pool's tokenizer: CPU of
a cold chat (a ``--stall-long-words`` system prompt and a user message), of a second chat
under the same system prompt with another user message, of the same kind of chat under a
known system prompt of ``SHORT_SYSTEM_WORDS`` words, and of encoding another fresh message of
the same length alone (not the second chat's own: HF tokenizers' word cache would serve it).
Each is measured apart from the others, with the threads a parallel encode leaves spinning
counted where they were started, less an empty call's CPU; the four alternate, so a drifting
machine moves them alike.

"Pays only for its new text" is judged against the short-prompt chat, not the message alone:
a chat request is rendered through its template and its ids assembled whatever its system
prompt, and a chat under a 20-word prompt pays for nothing but its new text. What the long
known prompt adds over it (``known_prompt_extra_ms``) is what the new conversation pays for
the prompt it did not have to encode; ``pays_only_new_text`` holds when that is at most
``KNOWN_PROMPT_SHARE`` of the prompt's cold encode (re-encoding it would cost all of it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from loadtest.report import percentile
from loadtest.stack import Stack
from loadtest.workloads import WORDS

__all__ = ["add_arguments", "new_conversation_cost", "run_stall"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--stall-seconds", type=float, default=8.0, help="seconds per stall phase (0: skip)")
    a("--stall-rounds", type=int, default=2, help="stall phases per gateway, alternating")
    a("--stall-short-rate", type=float, default=40.0, help="short chats/s in stall phases")
    a("--stall-long-rate", type=float, default=4.0, help="cold long chats/s in stall phases")
    a("--stall-long-words", type=int, default=6000, help="words of each cold long chat")


def _pct(xs: list[float], q: float) -> float | None:
    return round(percentile(xs, q), 2) if xs else None  # None: JSON has no NaN


def _novel(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _chat(model: str, messages: list[dict[str, str]]) -> bytes:
    body = {"model": model, "messages": messages, "max_tokens": 1, "stream": True}
    return json.dumps(body).encode()


Result = float | str | tuple[float | str, float | str]


async def _ttft(session: aiohttp.ClientSession, url: str, body: bytes) -> float | str:
    """Milliseconds to the first SSE chunk, or an error text."""
    t0 = time.perf_counter()
    try:
        async with session.post(
            url + "/v1/chat/completions", data=body, headers={"content-type": "application/json"}
        ) as resp:
            if resp.status != 200:
                return f"HTTP {resp.status}"
            first = await resp.content.readany()
            ttft = (time.perf_counter() - t0) * 1e3
            await resp.read()  # to the end: the connection goes back to the pool
            return ttft if first else "empty stream"
    except (TimeoutError, aiohttp.ClientError) as exc:
        return f"{type(exc).__name__}: {exc}"


async def _arrivals(
    rate: float, seconds: float, rng: random.Random, send: Callable[[], Any]
) -> list[Result]:
    """Open-loop Poisson arrivals for ``seconds``; each one's result."""
    if rate <= 0:
        return []
    loop = asyncio.get_running_loop()
    t = loop.time()
    end = t + seconds
    tasks: list[asyncio.Task[Result]] = []
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            break
        await asyncio.sleep(max(0.0, t - loop.time()))
        tasks.append(asyncio.create_task(send()))
    return list(await asyncio.gather(*tasks))


async def _phase(
    session: aiohttp.ClientSession,
    url: str,
    worker: str,
    model: str,
    args: argparse.Namespace,
    long_rate: float,
    seed: str,
) -> dict[str, list[Result]]:
    rng = random.Random(seed)
    count = iter(range(1 << 30))

    async def short() -> Result:
        n = next(count)
        routed, direct = (
            _chat(model, [{"role": "user", "content": f"Say something about {who} {n}."}])
            for who in ("it", "that")
        )
        a, b = await asyncio.gather(_ttft(session, url, routed), _ttft(session, worker, direct))
        return (a, b)

    def long() -> Any:
        messages = [
            {"role": "system", "content": _novel(rng, args.stall_long_words)},
            {"role": "user", "content": _novel(rng, 20)},
        ]
        return _ttft(session, url, _chat(model, messages))

    shorts, longs = await asyncio.gather(
        _arrivals(args.stall_short_rate, args.stall_seconds, random.Random(seed + "s"), short),
        _arrivals(long_rate, args.stall_seconds, random.Random(seed + "l"), long),
    )
    return {"short": shorts, "long": longs}


def _summary(results: list[dict[str, list[Result]]]) -> dict[str, Any]:
    pairs = [x for r in results for x in r["short"] if isinstance(x, tuple)]
    ok = [(a, b) for a, b in pairs if isinstance(a, float) and isinstance(b, float)]
    short = [a for a, _ in ok]
    direct = [b for _, b in ok]
    added = [a - b for a, b in ok]
    long = [x for r in results for x in r["long"] if isinstance(x, float)]
    flat = [y for x in (*pairs, *(x for r in results for x in r["long"])) for y in _items(x)]
    errors = [x for x in flat if isinstance(x, str)]
    return {
        "short_requests": len(short),
        "short_ttft_p50_ms": _pct(short, 0.5),
        "short_ttft_p99_ms": _pct(short, 0.99),
        "short_ttft_max_ms": _pct(short, 1.0),
        "direct_ttft_p50_ms": _pct(direct, 0.5),
        "direct_ttft_p99_ms": _pct(direct, 0.99),
        "added_p50_ms": _pct(added, 0.5),
        "added_p99_ms": _pct(added, 0.99),
        "long_requests": len(long),
        "long_ttft_p50_ms": _pct(long, 0.5),
        "errors": len(errors),
        "error_examples": errors[:3],
    }


def _items(x: Result) -> tuple[float | str, ...]:
    return x if isinstance(x, tuple) else (x,)


async def _measure(
    urls: dict[str, str], worker: str, model: str, args: argparse.Namespace
) -> dict[str, Any]:
    """Phases: quiet (offload on, short chats alone), offload on, offload off; alternated."""
    plan = [("quiet", urls["offload"], 0.0), ("offload", urls["offload"], args.stall_long_rate)]
    plan.append(("no_offload", urls["no_offload"], args.stall_long_rate))
    out: dict[str, list[dict[str, list[Result]]]] = {name: [] for name, _, _ in plan}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for rnd in range(args.stall_rounds):
            for name, url, long_rate in plan if rnd % 2 == 0 else plan[::-1]:
                seed = f"{args.seed}-stall-{rnd}-{name}"
                phase = await _phase(session, url, worker, model, args, long_rate, seed)
                out[name].append(phase)
    return {name: _summary(results) for name, results in out.items()}


def run_stall(
    stack: Stack, run_async: Callable[[Any], Any], args: argparse.Namespace
) -> dict[str, Any]:
    """The stall figures on ``stack`` (gateway 0 offloads as configured): a second gateway
    process with ``tokenize_thread_chars: 0`` is started for the comparison."""
    pool = stack.gateway_config(0)["pools"][0]
    g = len(stack.gateways)
    stack.start_gateway(g, pools=[{**pool, "tokenize_thread_chars": 0}])
    stack.wait_ready()
    urls = {"offload": stack.gateway_urls[0], "no_offload": stack.gateway_urls[g]}
    worker = stack.worker_urls[0]
    phases: dict[str, Any] = run_async(_measure(urls, worker, stack.config.model, args))
    on, off = phases["offload"], phases["no_offload"]
    a, b = on["added_p99_ms"], off["added_p99_ms"]
    return {
        "phases": phases,
        "added_p99_offload_vs_no_offload": round(a / b, 3) if a and b else None,
        "tokenize_thread_chars": pool.get("tokenize_thread_chars", "default (8192)"),
    }


#: idle time before and after each measured call: HF tokenizers' threads spin for a while after
#: a parallel batch returns, so a call measured right after the cold chat was charged the cold
#: chat's spinning, and each call's own spinning after it returns is its cost too
_SETTLE_S = 0.005


#: the known short system prompt of the baseline chat, and how many times each call is timed
SHORT_SYSTEM_WORDS = 20
_NEW_CONVERSATION_REPEATS = 7
#: the most of a known prompt's cold encode that a new conversation under it may pay
KNOWN_PROMPT_SHARE = 0.05


def _settled_cpu(fn: Callable[[], Any]) -> float:
    """Process CPU seconds of ``fn`` and of the settle time after it, after a settle before it."""
    time.sleep(_SETTLE_S)
    cpu = time.process_time()
    fn()
    time.sleep(_SETTLE_S)
    return time.process_time() - cpu


def new_conversation_cost(tokenizer_path: str, template: str, words: int) -> dict[str, Any]:
    """CPU ms: a cold chat, a new chat under its (now known) system prompt, a new chat under a
    known short system prompt, and a new chat's user message encoded alone (median of
    ``_NEW_CONVERSATION_REPEATS``, fresh texts every time), each measured apart from the
    others' threads, less an empty call's."""
    from gateway.tokenization import Tokenizer

    rng = random.Random(11)
    cold, new, short, alone, idle = [], [], [], [], []
    for _ in range(_NEW_CONVERSATION_REPEATS):
        tok = Tokenizer.load(tokenizer_path, template)
        system = {"role": "system", "content": _novel(rng, words)}
        brief = {"role": "system", "content": _novel(rng, SHORT_SYSTEM_WORDS)}
        first = [system, {"role": "user", "content": _novel(rng, 60)}]
        tok.encode_chat([brief, {"role": "user", "content": _novel(rng, 60)}])  # now known
        # the new text alone is another fresh text of the same length: HF tokenizers caches
        # the words it has seen, so the new chat's own text would be cheaper the second time
        user, other, third = _novel(rng, 60), _novel(rng, 60), _novel(rng, 60)
        cold.append(_settled_cpu(lambda: tok.encode_chat(first)))  # noqa: B023 (called at once)
        # as a request brings them: strings parsed anew, their hashes not yet cached
        chat = [_fresh(system), {"role": "user", "content": user}]
        new.append(_settled_cpu(lambda: tok.encode_chat(chat)))  # noqa: B023
        chat2 = [_fresh(brief), {"role": "user", "content": third}]
        short.append(_settled_cpu(lambda: tok.encode_chat(chat2)))  # noqa: B023
        alone.append(_settled_cpu(lambda: tok.encode(other, add_special_tokens=False)))  # noqa: B023
        idle.append(_settled_cpu(lambda: None))
        tok.close()
    base = sorted(idle)[len(idle) // 2]
    cold, new, short, alone = ([max(x - base, 0.0) for x in xs] for xs in (cold, new, short, alone))

    def med(xs: list[float]) -> float:
        return round(sorted(xs)[len(xs) // 2] * 1e3, 3)

    extra = round(med(new) - med(short), 3)
    return {
        "system_words": words,
        "cold_chat_cpu_ms": med(cold),
        "new_conversation_cpu_ms": med(new),
        "short_system_cpu_ms": med(short),
        "new_text_alone_cpu_ms": med(alone),
        "new_conversation_vs_cold": round(med(new) / med(cold), 3) if med(cold) else None,
        "known_prompt_extra_ms": extra,
        "known_prompt_extra_vs_cold": round(extra / med(cold), 4) if med(cold) else None,
        "pays_only_new_text": bool(med(cold) and extra <= KNOWN_PROMPT_SHARE * med(cold)),
    }


def _fresh(message: dict[str, str]) -> dict[str, str]:
    """``message`` with its strings as new objects, as a request's JSON parse makes them."""
    return {k: (v + " ")[:-1] for k, v in message.items()}
