"""The HTTP API of a simulated worker (aiohttp): OpenAI endpoints plus each engine's own.

Both flavors: ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming or not, ``usage``
with ``prompt_tokens_details.cached_tokens``), ``/v1/responses`` (``agent_apis``), ``/v1/models``, ``/health``, ``/ping``,
``/version``, ``/metrics``, ``/tokenize``, ``/detokenize``, and the simulator's
``/sim/state`` and ``POST /sim/fault``. vLLM adds ``/v1/messages`` (Anthropic's API),
``/reset_prefix_cache``,
``/kv_event_sources`` (vLLM 0.32+'s object keyed by data-parallel rank), ``/load``,
``/v1/chat/completions/render`` and ``/v1/completions/render`` (vLLM's render API: the token
ids a request becomes, as a ``GenerateRequest``), and ``/get_server_info`` (the ``block_size``
that vllm-router's KV-event discovery reads; real vLLM has no such route); SGLang adds ``/generate``, ``/server_info``,
``/model_info`` (and their ``/get_*`` aliases), ``/health_generate``, ``/flush_cache``,
``/get_load`` and ``/v1/loads``.

Every error is a 4xx with an OpenAI-style body; a bug is a logged 500, never a crash.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from loadtest.enginesim.agent_apis import (
    EventShape,
    MessagesShape,
    ResponsesShape,
    anthropic_error,
    parse_messages,
    parse_responses,
)
from loadtest.enginesim.api import (
    ApiError,
    GenRequest,
    UnknownRank,
    check_model,
    check_prompt,
    decode_body,
    error_body,
    parse_chat,
    parse_completion,
    parse_generate,
    parse_token_ids,
    pinned_rank,
)
from loadtest.enginesim.disagg import (
    FAKE_BOOTSTRAP_HOST,
    decode_source,
    pull,
    vllm_prefill_params,
)
from loadtest.enginesim.kvcache import TOKEN_BYTES, pack_tokens, unpack_tokens
from loadtest.enginesim.metrics import CONTENT_TYPE
from loadtest.enginesim.scheduler import RequestTooLarge

if TYPE_CHECKING:
    from loadtest.enginesim.worker import Generation, SimWorker

__all__ = ["ENGINE_VERSIONS", "build_app"]

log = logging.getLogger(__name__)

ENGINE_VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23"}
_DONE = b"data: [DONE]\n\n"
_HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT
_FLUSH_BUSY = (
    "Cache not flushed. There are running or waiting requests. Please check backend logs "
    "for more details. (When there are running or waiting requests, the operation will not "
    "be performed.)\n"
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(worker: SimWorker) -> web.Application:
    """The aiohttp application of one worker (a new one per start: apps are single-use)."""
    app = web.Application(client_max_size=worker.config.max_body_bytes, middlewares=[_errors])
    h = _Handlers(worker)
    r = app.router
    r.add_post("/v1/completions", h.completions)
    r.add_post("/v1/chat/completions", h.chat)
    r.add_post("/v1/responses", h.responses)
    r.add_get("/v1/models", h.models_list)
    for path in ("/health", "/ping"):
        r.add_get(path, h.health)
    r.add_post("/ping", h.health)
    r.add_get("/version", h.version)
    r.add_get("/metrics", h.metrics)
    r.add_post("/tokenize", h.tokenize)
    r.add_post("/detokenize", h.detokenize)
    r.add_get("/sim/state", h.sim_state)
    if worker.config.pd.role == "prefill":
        r.add_get("/sim/pd/pull", h.pd_pull)
    r.add_post("/sim/fault", h.sim_fault)
    if worker.config.flavor == "vllm":
        r.add_post("/v1/messages", h.messages)
        r.add_post("/reset_prefix_cache", h.reset_prefix_cache)
        r.add_get("/kv_event_sources", h.kv_event_sources)
        r.add_get("/load", h.load)
        r.add_post("/v1/chat/completions/render", h.render_chat)
        r.add_post("/v1/completions/render", h.render_completion)
        r.add_get("/get_server_info", h.vllm_server_info)
    else:
        r.add_post("/generate", h.generate)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, h.server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, h.model_info)
        r.add_get("/health_generate", h.health_generate)
        r.add_route("*", "/flush_cache", h.flush_cache)
        r.add_get("/get_load", h.get_load)
        r.add_get("/v1/loads", h.v1_loads)
    return app


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(data), status=status, content_type="application/json"
    )


def _sse(data: Any) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        if request.path == "/v1/messages":
            return _json(anthropic_error(exc.status, exc.body()), exc.status)
        return _json(exc.body(), exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _json(error_body(exc.status, exc.reason), exc.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("internal error serving %s %s", request.method, request.path)
        return _json(error_body(500, "Internal server error"), 500)


class _Handlers:
    """Request handlers bound to one worker."""

    def __init__(self, worker: SimWorker) -> None:
        self.w = worker
        self.cfg = worker.config
        self.codec = worker.codec
        self.served = {self.cfg.model, *self.cfg.lora.adapters}
        self.owner = self.cfg.flavor

    # -- generation ------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        g = parse_completion(body, self.served, self.cfg.scheduler.default_max_tokens)
        ids = await self._prompt(g)
        shape = _CompletionShape(self, f"cmpl-{uuid.uuid4().hex}")
        return await self._generate(request, g, ids, shape, body)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        g = parse_chat(body, self.served, self.cfg.scheduler.default_max_tokens)
        ids = pack_tokens(await self._chat_ids(g))
        shape = _ChatShape(self, f"chatcmpl-{uuid.uuid4().hex}")
        return await self._generate(request, g, ids, shape, body)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        g = parse_responses(body, self.served, self.cfg.scheduler.default_max_tokens)
        ids = pack_tokens(await self._chat_ids(g))
        shape = ResponsesShape(self.cfg.model, self.codec.output_text, body)
        return await self._generate(request, g, ids, shape, body)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        g = parse_messages(body, self.served)
        ids = pack_tokens(await self._chat_ids(g))
        shape = MessagesShape(self.cfg.model, self.codec.output_text)
        return await self._generate(request, g, ids, shape, body)

    def _lora(self, body: dict[str, Any]) -> str | None:
        """The LoRA adapter a request's ``model`` names (already checked to be served)."""
        model = body.get("model")
        return model if model in self.cfg.lora.adapters else None

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        g = parse_generate(body)
        ids = await self._prompt(g)
        shape = _GenerateShape(self, g.request_id or uuid.uuid4().hex)
        return await self._generate(request, g, ids, shape, body)

    async def _chat_ids(self, g: GenRequest) -> list[int]:
        assert g.messages is not None
        return await self.codec.encode_chat(
            g.messages, g.tools, g.add_generation_prompt, g.chat_kwargs
        )

    async def _prompt(self, g: GenRequest) -> bytes:
        if g.prompt_tokens is not None:
            return g.prompt_tokens
        return pack_tokens(await self.codec.encode(g.prompt_text or ""))

    async def _encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        if add_special_tokens:
            return await self.codec.encode(text)
        tk = self.codec.tokenizer
        if tk is None:
            raise ApiError(400, "This simulator runs without a tokenizer: send token ids")
        from gateway.tokenization import TokenizationError

        try:
            return await tk.aencode(text, add_special_tokens=False)
        except TokenizationError as exc:
            raise ApiError(400, str(exc), "prompt") from None

    async def _generate(
        self,
        request: web.Request,
        g: GenRequest,
        ids: bytes,
        shape: _Shape | EventShape,
        body: dict[str, Any] | None = None,
    ) -> web.StreamResponse:
        check_prompt(ids, g.max_tokens, self.cfg.scheduler.max_model_len, self.codec.vocab_size)
        body = body or {}
        rank = pinned_rank(self.cfg.flavor, request.headers, body)
        if not self.w.alive:
            raise ApiError(503, "The engine is not running")
        key, params, remote = await self._disaggregation(g, ids, body, rank)
        try:
            gen = self.w.submit(
                ids, g.max_tokens, stream=g.stream, rank=rank, remote=remote,
                lora=self._lora(body),
            )  # fmt: skip
        except RequestTooLarge as exc:
            raise ApiError(400, str(exc), "max_tokens") from None
        except UnknownRank as exc:
            raise ApiError(400, str(exc), "data_parallel_rank") from None
        shape.prompt_tokens = len(ids) // TOKEN_BYTES
        try:
            if g.stream:
                return await self._stream(request, g, gen, shape)
            while not gen.finished:
                if gen.error:
                    raise ApiError(503, gen.error)
                await gen.wait()
            full = shape.full(gen)
            if params is not None:
                full["kv_transfer_params"] = params
            return _json(full)
        finally:
            if not gen.finished:
                self.w.abort(gen)
            if key is not None:
                if gen.finished:
                    self.w.transfers.done(key, shape.prompt_tokens)
                else:
                    self.w.transfers.failed(key)

    async def _disaggregation(
        self, g: GenRequest, ids: bytes, body: dict[str, Any], rank: int | None
    ) -> tuple[str | None, dict[str, Any] | None, bool]:
        """Prefill/decode disaggregation (``loadtest.enginesim.disagg``): a prefill engine's
        transfer key and the ``kv_transfer_params`` it answers with (vLLM); for a decode
        engine, the pull of the prompt's KV from the prefill engine (then ``remote``)."""
        pd, flavor = self.cfg.pd, self.cfg.flavor
        if pd.role == "prefill":
            if flavor == "vllm":
                asked = body.get("kv_transfer_params")
                if isinstance(asked, dict) and asked.get("do_remote_decode"):
                    engine_id = f"sim-{self.w.index}-{self.w.started_at:.6f}"
                    key, params = vllm_prefill_params(self.cfg.host, self.w.http_port, engine_id)
                    return key, params, False
                return None, None, False
            room = body.get("bootstrap_room")
            if room is None:  # SGLang's prefill engines refuse a request that no decode pairs
                raise ApiError(400, "a prefill engine needs bootstrap_room", "bootstrap_room")
            if not isinstance(room, int):
                raise ApiError(400, "bootstrap_room must be an integer", "bootstrap_room")
            g.max_tokens = 1  # a prefill engine stops at the first token; decode does the rest
            if body.get("bootstrap_host") == FAKE_BOOTSTRAP_HOST:
                return None, None, False  # SGLang's fake KV sender: computed, cached, not sent
            return f"room-{room}", None, False
        if pd.role == "decode":
            source = decode_source(flavor, body)
            if source is None:
                if flavor == "sglang":
                    raise ApiError(400, "a decode engine needs bootstrap_host/port/room")
                return None, None, False
            core = self.w.ranks[rank if rank is not None else 0].core
            uncached = len(ids) // TOKEN_BYTES - core.lookup(ids)
            await pull(source, pd, self.cfg.timing.speedup, uncached)
            return None, None, True
        return None, None, False

    async def pd_pull(self, request: web.Request) -> web.Response:
        """A decode engine pulls the KV of a finished prefill (waits until it is ready)."""
        key = request.query.get("key", "")
        tokens = await self.w.transfers.wait(key, self.cfg.pd.wait_timeout)
        if tokens is None:
            raise ApiError(404, f"no KV to transfer under {key!r}")
        return _json({"key": key, "tokens": tokens})

    async def _stream(
        self, request: web.Request, g: GenRequest, gen: Generation, shape: _Shape | EventShape
    ) -> web.StreamResponse:
        # Like vLLM, nothing is sent (not even headers) before the first token: the engine's
        # output generator yields its role chunk on the first result. A failure before then
        # is an ordinary HTTP error, which a router may still retry elsewhere.
        while not (gen.produced or gen.finished or gen.error):
            await gen.wait()
        if gen.error and not gen.produced:
            return _json(error_body(503, gen.error), 503)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        await resp.write(shape.sse_opening(gen))
        sent = 0
        while True:
            if not (gen.produced > sent or gen.finished or gen.error):
                await gen.wait()
            if gen.error:
                await resp.write(_sse(error_body(503, gen.error)))
                return resp
            if gen.produced > sent or gen.finished:
                data = shape.sse_chunk(gen, sent, gen.produced)
                if data:
                    await resp.write(data)
                sent = gen.produced
            if gen.finished:
                break
        await resp.write(shape.sse_closing(gen, g.include_usage))
        await resp.write_eof()
        return resp

    # -- common endpoints ------------------------------------------------------------------

    async def models_list(self, request: web.Request) -> web.Response:
        card = {
            "id": self.cfg.model,
            "object": "model",
            "created": int(self.w.started_at),
            "owned_by": self.owner,
            "root": self.cfg.model,
            "parent": None,
            "max_model_len": self.cfg.scheduler.max_model_len,
            "permission": [],
        }
        # LoRA adapters as vLLM lists them: root = the adapter's path, parent = the base
        loras = [
            {**card, "id": name, "root": f"/adapters/{name}", "parent": self.cfg.model}
            for name in self.cfg.lora.adapters
        ]
        return _json({"object": "list", "data": [card, *loras]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": ENGINE_VERSIONS[self.cfg.flavor]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.w.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize``: a ``TokenizeChatRequest`` (``messages``; special tokens come
        from the template) or a ``TokenizeCompletionRequest`` (``prompt``, with
        ``add_special_tokens`` default true); ``token_strs`` only with ``return_token_strs``."""
        body = await _body(request)
        if "messages" in body:
            ids = await self._chat_ids(parse_chat(body, self.served, 1))
        elif isinstance(body.get("prompt"), str):
            check_model(body, self.served)
            special = body.get("add_special_tokens", True)
            if not isinstance(special, bool):
                raise ApiError(400, "add_special_tokens must be a boolean", "add_special_tokens")
            ids = await self._encode_text(body["prompt"], special)
        else:
            raise ApiError(400, "prompt (a string) or messages is required", "prompt")
        strs = body.get("return_token_strs")
        if strs is not None and not isinstance(strs, bool):
            raise ApiError(400, "return_token_strs must be a boolean", "return_token_strs")
        token_strs = [self.codec.decode([i]) for i in ids] if strs else None
        limit = self.cfg.scheduler.max_model_len
        return _json(
            {"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": token_strs}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        tokens = (await _body(request)).get("tokens")
        if not isinstance(tokens, list):
            raise ApiError(400, "tokens must be a list of token ids", "tokens")
        ids = unpack_tokens(parse_token_ids(tokens, "tokens"))
        return _json({"prompt": self.codec.decode(ids)})

    async def sim_state(self, request: web.Request) -> web.Response:
        return _json(self.w.state())

    async def sim_fault(self, request: web.Request) -> web.Response:
        from loadtest.enginesim.worker import FaultError

        body = await _body(request)
        action = body.pop("action", None)
        if not isinstance(action, str):
            raise ApiError(400, "action (a string) is required", "action")
        try:
            state = await self.w.fault(action, spare=request.transport, **body)
        except (FaultError, TypeError) as exc:
            raise ApiError(400, str(exc), "action") from None
        resp = _json(state)
        if action in ("kill", "restart"):
            resp.force_close()  # the connection belongs to the engine that just died
        return resp

    # -- vLLM ------------------------------------------------------------------------------

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        return _json({"success": await self.w.reset_prefix_cache()})

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        """vLLM 0.32+: each data-parallel rank's ``KVEventsConfig`` keyed by the rank as a
        string (``{}`` with events off), endpoints as the rank's publisher bound them."""
        ev = self.cfg.events
        out: dict[str, Any] = {}
        for rank in self.w.ranks:
            pub = rank.publisher
            if pub is None:
                continue
            out[str(rank.index)] = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": pub.endpoint,
                "replay_endpoint": pub.replay_endpoint,
                "buffer_steps": ev.buffer_steps,
                "hwm": ev.hwm,
                "max_queue_size": 100000,
                "topic": ev.topic,
                "encoding": "msgpack",
                "schema_version": 1,
            }
        return _json(out)

    async def load(self, request: web.Request) -> web.Response:
        cores = self.w.cores()
        return _json({"server_load": sum(c.num_running + c.num_waiting for c in cores)})

    async def render_chat(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /v1/chat/completions/render``: the chat request rendered and tokenized
        as the engine would, returned as a ``GenerateRequest`` (what ``/inference/v1/generate``
        takes), without generating."""
        body = await _body(request)
        g = parse_chat(body, self.served, self.cfg.scheduler.default_max_tokens)
        ids = await self._chat_ids(g)
        return _json(self._generate_request(body, g, ids, "chatcmpl"))

    async def render_completion(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /v1/completions/render``: a list of ``GenerateRequest`` (one per
        prompt; the simulator takes one)."""
        body = await _body(request)
        g = parse_completion(body, self.served, self.cfg.scheduler.default_max_tokens)
        ids = unpack_tokens(await self._prompt(g))
        return _json([self._generate_request(body, g, ids, "cmpl")])

    def _generate_request(
        self, body: dict[str, Any], g: GenRequest, ids: list[int], prefix: str
    ) -> dict[str, Any]:
        if not ids:
            raise ApiError(400, "No token_ids rendered", "prompt")
        check_prompt(pack_tokens(ids), g.max_tokens, self.cfg.scheduler.max_model_len, None)
        temperature = body.get("temperature")
        sampling: dict[str, Any] = {
            "n": 1,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "temperature": 1.0 if temperature is None else float(temperature),
            "top_p": float(body.get("top_p") or 1.0),
            "top_k": 0,
            "min_p": 0.0,
            "seed": body.get("seed"),
            "stop": [],
            "stop_token_ids": [],
            "ignore_eos": bool(body.get("ignore_eos", False)),
            "max_tokens": g.max_tokens,
            "min_tokens": int(body.get("min_tokens") or 0),
            "logprobs": None,
            "prompt_logprobs": None,
            "skip_special_tokens": True,
            "spaces_between_special_tokens": True,
        }
        opts = body.get("stream_options") if g.stream else None
        return {
            "request_id": f"{prefix}-{uuid.uuid4().hex}",
            "token_ids": ids,
            "features": None,
            "sampling_params": sampling,
            "model": body.get("model"),
            "stream": g.stream,
            "stream_options": opts,
            "cache_salt": body.get("cache_salt"),
            "priority": int(body.get("priority") or 0),
            "kv_transfer_params": None,
        }

    async def vllm_server_info(self, request: web.Request) -> web.Response:
        """Not a vLLM route (vLLM's ``/server_info`` dumps its config): the fields that
        vllm-router's KV-event discovery reads from ``/get_server_info``."""
        cfg = self.cfg
        return _json(
            {
                "model_path": self._model_path(),
                "served_model_name": cfg.model,
                "block_size": cfg.cache.block_size,
                "max_model_len": cfg.scheduler.max_model_len,
                "data_parallel_size": self.cfg.dp_size,
                "version": ENGINE_VERSIONS["vllm"],
                "simulated": True,
            }
        )

    # -- SGLang ----------------------------------------------------------------------------

    async def server_info(self, request: web.Request) -> web.Response:
        cfg, core = self.cfg, self.w.core
        info: dict[str, Any] = {
            "model_path": self._model_path(),
            "served_model_name": cfg.model,
            "tokenizer_path": self.codec.source,
            "page_size": cfg.cache.block_size,
            "context_length": cfg.scheduler.max_model_len,
            "max_running_requests": cfg.scheduler.max_num_seqs,
            "chunked_prefill_size": cfg.scheduler.max_num_batched_tokens,
            "max_total_num_tokens": core.allocator.num_blocks * core.block_size,
            "tp_size": 1,
            "dp_size": cfg.dp_size,
            "host": cfg.host,
            "port": self.w.http_port,
            "version": ENGINE_VERSIONS["sglang"],
            "internal_states": [{"last_gen_throughput": 0.0, "load": core.num_running}],
            "simulated": True,
            "disaggregation_mode": cfg.pd.role or "null",
        }
        if cfg.pd.role == "prefill":  # the simulator's bootstrap is its HTTP port
            info["disaggregation_bootstrap_port"] = self.w.http_port
        pub = self.w.publisher
        if pub is not None:
            kv: dict[str, Any] = {
                "publisher": "zmq",
                "endpoint_host": pub.host,
                "endpoint_port_base": pub.port,
                "topic": cfg.events.topic,
                "block_size": cfg.cache.block_size,
                "dp_size": cfg.dp_size,
            }
            if pub.replay_port is not None:
                kv["replay_endpoint_port_base"] = pub.replay_port
            info["kv_events"] = kv
        return _json(info)

    def _model_path(self) -> str:
        """Where the model's tokenizer lives when known (peers load it from there)."""
        src = self.codec.source
        return str(Path(src).parent) if src else self.cfg.model

    async def model_info(self, request: web.Request) -> web.Response:
        return _json(
            {
                "model_path": self._model_path(),
                "tokenizer_path": self.codec.source,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "kvroute-sim",
                "architectures": ["SimulatedForCausalLM"],
            }
        )

    async def health_generate(self, request: web.Request) -> web.Response:
        if not self.w.alive:
            raise ApiError(503, "The engine is not running")
        gen = self.w.submit(pack_tokens([0]), 1, stream=False)
        try:
            async with asyncio.timeout(_HEALTH_GENERATE_TIMEOUT_S):
                while not gen.finished and not gen.error:
                    await gen.wait()
        except TimeoutError:
            raise ApiError(503, "health check timed out") from None
        finally:
            if not gen.finished:
                self.w.abort(gen)
        if gen.error:
            raise ApiError(503, gen.error)
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.w.busy or not await self.w.reset_prefix_cache():
            return web.Response(status=400, text=_FLUSH_BUSY)
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. (When there are "
            "running or waiting requests, the operation will not be performed.)\n"
        )

    async def get_load(self, request: web.Request) -> web.Response:
        now = time.time()
        return _json(
            [
                {
                    "dp_rank": r.index,
                    "num_reqs": r.core.num_running + r.core.num_waiting,
                    "num_waiting_reqs": r.core.num_waiting,
                    "num_tokens": r.core.used_blocks * r.core.block_size,
                    "num_pending_tokens": r.core.waiting_prompt_tokens,
                    "ts_tic": now,
                }
                for r in self.w.ranks
            ]
        )

    async def v1_loads(self, request: web.Request) -> web.Response:
        loads = []
        for rank in self.w.ranks:
            core = rank.core
            total = core.allocator.num_blocks * core.block_size
            used = core.used_blocks * core.block_size
            st = core.stats
            loads.append(
                {
                    "dp_rank": rank.index,
                    "num_running_reqs": core.num_running,
                    "num_waiting_reqs": core.num_waiting,
                    "num_total_reqs": core.num_running + core.num_waiting,
                    "num_used_tokens": used,
                    "max_total_num_tokens": total,
                    "token_usage": used / total,
                    "cache_hit_rate": st.cache_hits / st.cache_queries if st.cache_queries else 0.0,
                    "num_waiting_uncached_tokens": core.waiting_prompt_tokens,
                }
            )
        return _json({"timestamp": time.time(), "dp_rank_count": len(loads), "loads": loads})


async def _body(request: web.Request) -> dict[str, Any]:
    return decode_body(await request.read())


# -- response shapes -------------------------------------------------------------------------


class _Shape:
    """How one endpoint shapes its responses (non-streaming body and SSE chunks)."""

    def __init__(self, h: _Handlers, rid: str) -> None:
        self.h = h
        self.rid = rid
        self.created = int(time.time())
        self.prompt_tokens = 0

    def usage(self, gen: Generation) -> dict[str, Any]:
        n = gen.produced
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + n,
            "completion_tokens": n,
            "prompt_tokens_details": {"cached_tokens": gen.req.cached_tokens},
        }

    def text(self, start: int, end: int) -> str:
        return self.h.codec.output_text(start, end)

    def opening(self) -> list[dict[str, Any]]:
        return []

    def chunk(self, gen: Generation, start: int, end: int) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self, gen: Generation) -> dict[str, Any]:
        raise NotImplementedError

    def full(self, gen: Generation) -> dict[str, Any]:
        raise NotImplementedError

    def sse_opening(self, gen: Generation) -> bytes:
        return b"".join(map(_sse, self.opening()))

    def sse_chunk(self, gen: Generation, start: int, end: int) -> bytes:
        return _sse(self.chunk(gen, start, end))

    def sse_closing(self, gen: Generation, include_usage: bool) -> bytes:
        return (_sse(self.usage_chunk(gen)) if include_usage else b"") + _DONE

    def _envelope(self, obj: str, choices: list[Any]) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.h.cfg.model,
            "choices": choices,
        }


def _finish(gen: Generation) -> str | None:
    return "length" if gen.finished else None


class _CompletionShape(_Shape):
    def chunk(self, gen: Generation, start: int, end: int) -> dict[str, Any]:
        choice = {
            "index": 0,
            "text": self.text(start, end),
            "logprobs": None,
            "finish_reason": _finish(gen),
            "stop_reason": None,
        }
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, gen: Generation) -> dict[str, Any]:
        return {**self._envelope("text_completion", []), "usage": self.usage(gen)}

    def full(self, gen: Generation) -> dict[str, Any]:
        body = self.chunk(gen, 0, gen.produced)
        body["usage"] = self.usage(gen)
        return body


class _ChatShape(_Shape):
    def opening(self) -> list[dict[str, Any]]:
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [self._envelope("chat.completion.chunk", [choice])]

    def chunk(self, gen: Generation, start: int, end: int) -> dict[str, Any]:
        choice = {
            "index": 0,
            "delta": {"content": self.text(start, end)},
            "logprobs": None,
            "finish_reason": _finish(gen),
            "stop_reason": None,
        }
        return self._envelope("chat.completion.chunk", [choice])

    def usage_chunk(self, gen: Generation) -> dict[str, Any]:
        return {**self._envelope("chat.completion.chunk", []), "usage": self.usage(gen)}

    def full(self, gen: Generation) -> dict[str, Any]:
        message = {"role": "assistant", "content": self.text(0, gen.produced), "tool_calls": []}
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
        return {**self._envelope("chat.completion", [choice]), "usage": self.usage(gen)}


class _GenerateShape(_Shape):
    """SGLang's native ``/generate``: cumulative text and ids in every streamed chunk."""

    def chunk(self, gen: Generation, start: int, end: int) -> dict[str, Any]:
        req = gen.req
        meta = {
            "id": self.rid,
            "finish_reason": {"type": "length", "length": end} if gen.finished else None,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": end,
            "cached_tokens": req.cached_tokens,
            "e2e_latency": asyncio.get_running_loop().time() - req.arrival,
        }
        ids = self.h.w.core.output_token_ids(0, end)
        return {"text": self.text(0, end), "output_ids": ids, "meta_info": meta}

    def usage_chunk(self, gen: Generation) -> dict[str, Any]:
        return self.chunk(gen, 0, gen.produced)

    def full(self, gen: Generation) -> dict[str, Any]:
        return self.chunk(gen, 0, gen.produced)
