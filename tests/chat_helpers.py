"""Multi-turn chats through a running stack, recording what the gateway predicted and what
the engine reported (shared by the model-shape and data-parallel end-to-end tests)."""

from __future__ import annotations

import random

import openai

from loadtest.stack import Stack, wait_for

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
]


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def converged(stack: Stack) -> bool:
    """The gateway's index equals every agent's mirror (by key digest)."""
    return not stack.diverged()


def run_chats(
    stack: Stack, conversations: int, turns: int, shared_system: bool = True
) -> list[tuple[int, int, int, str]]:
    """(predicted, reported cached, prompt tokens, worker) per request of multi-turn chats
    (round-robin over the conversations, turn by turn) that share a system prompt, or each
    have their own; each request is sent once the index caught up with the engines."""
    client = openai.OpenAI(base_url=stack.gateway_urls[0] + "/v1", api_key="none", max_retries=0)
    rng = random.Random(12)
    system = text(rng, 300)
    chats = [
        [{"role": "system", "content": system if shared_system else text(rng, 300)}]
        for _ in range(conversations)
    ]
    out = []
    for _ in range(turns):
        for msgs in chats:
            msgs.append({"role": "user", "content": text(rng, rng.randint(20, 60))})
            assert wait_for(lambda: converged(stack), 15) is not None, stack.diverged()
            r = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=msgs,  # type: ignore[arg-type]
                max_tokens=8,
            )
            comp = r.parse()
            assert comp.usage and comp.usage.prompt_tokens_details
            out.append(
                (
                    int(r.headers["x-kvroute-matched-tokens"]),
                    comp.usage.prompt_tokens_details.cached_tokens or 0,
                    comp.usage.prompt_tokens,
                    r.headers["x-kvroute-worker"],
                )
            )
            msgs.append({"role": "assistant", "content": comp.choices[0].message.content or ""})
    return out
