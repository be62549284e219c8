"""`composer-jax serve`: an OpenAI-compatible HTTP server over the continuous-batching sampler.

Endpoints (all but /health need `Authorization: Bearer KEY`):
    GET  /health                 liveness, policy version, load (no key needed)
    GET  /metrics                Prometheus metrics (prometheus_client; `server/metrics.py`)
    GET  /v1/models              the served model
    POST /v1/completions         prompt string / token ids (or a list of them); stream, logprobs
    POST /v1/chat/completions    messages (+ tools) in the chat template; tool_calls; stream, logprobs
    POST /admin/load_weights     {"checkpoint": DIR, "version"?, "step"?, "source"?: "checkpoint"} or
                                 {"source": "weight_store", "url"?: URL, "version"?: N (default latest)}

With `weights_from` (serve --weights-from URL) the server also follows an RL weight-sync store: every
`poll_interval_s` it reads the store's latest version and, when it is newer than the served one,
swaps it in between two decode steps (running requests continue; each token keeps the version that
produced it). Served version numbers are the published ones. /health reports the store, the last
error reading it and the last fallback (a bad version replaced by an older one).

Requests and responses: `server/openai_api.py` (extension fields: top_k, return_routing,
return_prompt_routing, stop_token_ids, ignore_eos, return_token_ids, prompt_logprobs (vLLM's, 0 only:
`server/prompt_logprobs.py`); token_ids, token_versions,
routed_experts, prompt_routed_experts, prompt_token_ids, malformed_tool_calls). Errors: `{"error": {"message", "type",
"param", "code"}}` with a 4xx status for a bad request, 401 without the key (OpenAI's
invalid_request_error / invalid_api_key), 429 with `Retry-After` when the engine is full, 500 when
the engine failed the request (the server keeps serving).

Architecture: one engine thread owns the Sampler (`engine/thread_engine.py`); handlers submit requests and
await their events through an asyncio queue fed with `call_soon_threadsafe`. Streaming reads each
request's tokens after every decode step (`Sampler.running()`), one `ChoiceStream` per choice
turning them into chunks (text, logprobs, tool-call deltas); a client that disconnects
mid-stream has its requests cancelled (`Sampler.cancel`), freeing the slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import jax
from starlette.applications import Starlette
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from composer_jax.checkpoint.validate import CheckpointError, config_differences
from composer_jax.config import to_dict
from composer_jax.errors import ConfigError
from composer_jax.formats.chat_format import chat_format
from composer_jax.formats.tokenizer import Tokenizer
from composer_jax.hf.lora_export import LoraRun
from composer_jax.inference.engine.batch_sampler import Request
from composer_jax.inference.engine.driver import Event
from composer_jax.inference.engine.thread_engine import Engine, EngineFull, EngineStopped
from composer_jax.inference.server import openai_api as api
from composer_jax.inference.server.metrics import CONTENT_TYPE, ObserveRequests, ServeMetrics
from composer_jax.inference.server.openai_api import ApiError, Generation
from composer_jax.inference.server.policy import Policy
from composer_jax.inference.server.prompt_logprobs import PromptScorer, prompt_logprobs_field
from composer_jax.weightsync.store import WeightSyncError
from composer_jax.weightsync.subscriber import StoreVersion, StoreWeights

_log = logging.getLogger("composer_jax.inference.server.app")

DEFAULT_MAX_BODY_BYTES = 16 * 2**20
SOURCES = ("checkpoint", "weight_store")
# a stream's chunk objects, as OpenAI names them (legacy completions stream "text_completion" objects)
STREAM_OBJECT = {"text_completion": "text_completion", "chat.completion": "chat.completion.chunk"}
RETRY_AFTER_S = 1  # the 429's Retry-After (whole seconds, as the header is read by clients)


def _error(e: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


@contextlib.contextmanager
def _swap_errors(failed: str, current: int) -> Iterator[None]:
    """The answers of a weight swap that did not happen: 503 when the engine stopped, 500 naming what
    `failed` when its first decode step raised (the engine put version `current` back); an `ApiError`
    raised inside passes as it is."""
    try:
        yield
    except ApiError:
        raise
    except EngineStopped as e:
        raise ApiError(503, str(e), code="shutting_down") from None
    except Exception as e:
        raise ApiError(
            500,
            f"{failed} ({type(e).__name__}: {str(e)[:300]}); version {current} is back in place",
            code="engine_error",
        ) from None


class _Auth(BaseHTTPMiddleware):
    """Bearer key on every path but /health (compared in constant time)."""

    def __init__(self, app: Any, key: str):
        super().__init__(app)
        self._expected = f"Bearer {key}".encode()

    async def dispatch(self, request: HttpRequest, call_next: Any) -> Response:
        if request.url.path != "/health":
            given = request.headers.get("authorization", "").encode()
            if not secrets.compare_digest(given, self._expected):
                what = "no Authorization header" if not given else "a wrong key"
                return _error(
                    ApiError(
                        401,
                        f"{what}: send 'Authorization: Bearer KEY' with the server's API key",
                        code="invalid_api_key",
                    ),
                    {"WWW-Authenticate": "Bearer"},
                )
        return await call_next(request)


class OpenAIServer:
    """The HTTP side: request checking, submission to the engine, responses and streams.

    load_policy(checkpoint, step) -> Policy reads weights for /admin/load_weights (on the served
    mesh). weights_from: a weight-sync store URL to follow, polled every poll_interval_s seconds
    (module docstring)."""

    def __init__(
        self,
        engine: Engine,
        tok: Tokenizer,
        *,
        model_name: str,
        api_key: str,
        load_policy: Callable[[str, int | None], Policy] | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        weights_from: str | None = None,
        poll_interval_s: float = 1.0,
        lora: LoraRun | None = None,
    ):
        if len(api_key) < 16:
            raise ConfigError("the API key must be at least 16 characters")
        if isinstance(poll_interval_s, bool) or not isinstance(poll_interval_s, (int, float)) or poll_interval_s <= 0:
            raise ConfigError(f"poll_interval_s={poll_interval_s!r}; accepted: a number of seconds > 0")
        self.engine, self.tok, self.model_name = engine, tok, model_name
        self.max_len = engine.sampler.max_len
        self.vocab = engine.sampler.cfg.vocab_size
        self.scorer = PromptScorer(engine.sampler.cfg, engine.sampler.sharding)
        self.load_policy = load_policy
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self._load_lock = asyncio.Lock()
        self.store = StoreWeights()
        self.lora = lora  # serving a train.lora run: its base and adapters (`_swap_from_store`)
        self.weights_from, self.poll_interval_s = weights_from, float(poll_interval_s)
        if weights_from is not None:
            try:
                self.store.subscriber(weights_from)
            except WeightSyncError as e:
                raise ConfigError(f"weights_from: {e}") from None
        self.store_error: str | None = None  # the last failure reading the followed store
        self.store_fallback: str | None = None  # the last version replaced by an older one
        self.queued_version: int | None = None  # the latest store version handed to the engine
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/admin/load_weights", self.load_weights, methods=["POST"]),
            Route("/metrics", self.get_metrics, methods=["GET"]),
        ]
        self.metrics = ServeMetrics(
            engine, model_name=model_name, max_len=self.max_len, endpoints=[r.path for r in routes]
        )
        engine.driver.first_token = self.metrics.first_token_seconds.observe
        self.app = Starlette(
            routes=routes,
            exception_handlers={Exception: self._unexpected, 404: self._not_found, 405: self._not_found},
            lifespan=self._lifespan,
        )
        self.app.add_middleware(_Auth, key=api_key)
        self.app.add_middleware(ObserveRequests, metrics=self.metrics)  # outermost: 401s count too

    # ------------------------------------------------------------------ following the store
    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Any) -> AsyncIterator[None]:
        self.metrics.watch_http_thread()  # the event loop's thread: its CPU seconds are scraped
        task = asyncio.create_task(self._follow()) if self.weights_from is not None else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _follow(self) -> None:
        """Poll the store; swap in each version newer than the served one (errors are logged and
        reported on /health, and the next poll tries again)."""
        url = self.weights_from
        assert url is not None
        while True:
            try:
                latest = await asyncio.to_thread(self.store.latest, url)
                if latest is not None and latest > self.engine.version:
                    async with self._load_lock:
                        if latest > self.engine.version:
                            await self._swap_from_store(url, latest)
                self.store_error = None
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep serving the current weights; the next poll retries
                self.store_error = f"{type(e).__name__}: {str(e)[:500]}"
                _log.error("following the weight store %s failed: %s", url, self.store_error)
            await asyncio.sleep(self.poll_interval_s)

    async def _swap_from_store(self, url: str, version: int | None) -> tuple[StoreVersion, int | None]:
        """Read `version` (None: latest) and swap it in if newer than the served one; -> (what was
        read, the previous version, or None when nothing was swapped). Call under `_load_lock`.
        Serving a train.lora run (`self.lora`), a version is that run's adapters: they are read
        into the adapters' tree and merged into the kept base (W + alpha / rank A B)."""
        lora = self.lora  # (its adapters: the checkpoint's, the tree every version of the run has)
        served = lora.adapters if lora is not None else self.engine.sampler.params
        got = await asyncio.to_thread(self.store.read, url, version, served)
        if got.fallback is not None:
            self.store_fallback = got.fallback
            _log.warning("weight store %s: %s", url, got.fallback)
        if got.version <= self.engine.version:
            return got, None
        params = got.params
        if lora is not None:
            params = await asyncio.to_thread(lora.merge, got.params)
        future = self.engine.update_weights(params, got.version)
        self.queued_version = got.version
        return got, await asyncio.wrap_future(future)

    # ------------------------------------------------------------------ plumbing
    async def _unexpected(self, request: HttpRequest, exc: Exception) -> JSONResponse:
        _log.exception("unexpected error in %s", request.url.path, exc_info=exc)
        return _error(ApiError(500, f"internal error: {type(exc).__name__}: {str(exc)[:300]}", code="internal_error"))

    async def _not_found(self, request: HttpRequest, exc: Exception) -> JSONResponse:
        status = getattr(exc, "status_code", 404)
        paths = (
            "GET /health, GET /metrics, GET /v1/models, POST /v1/completions, POST /v1/chat/completions, "
            "POST /admin/load_weights"
        )
        what = "no such endpoint" if status == 404 else "method not allowed"
        return _error(ApiError(status, f"{request.method} {request.url.path}: {what}; endpoints: {paths}"))

    async def _body(self, request: HttpRequest) -> Any:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise ApiError(413, f"the request body is {declared} bytes; the limit is {self.max_body_bytes}")
        raw = await request.body()
        if len(raw) > self.max_body_bytes:
            raise ApiError(413, f"the request body is {len(raw)} bytes; the limit is {self.max_body_bytes}")
        t0 = time.perf_counter()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        finally:
            self.metrics.http_seconds.inc(time.perf_counter() - t0)

    # ------------------------------------------------------------------ small endpoints
    async def health(self, request: HttpRequest) -> JSONResponse:
        e = self.engine
        return JSONResponse(
            {
                "status": "ok",
                "model": self.model_name,
                "policy_version": e.version,
                "slots": e.sampler.slots,
                "max_len": self.max_len,
                "in_engine": e.outstanding,
                "capacity": e.capacity if e.max_queued is not None else None,  # None: no bound
                "steps": e.steps,
                "slot_steps": e.slot_steps,
                "step_s": e.step_s,
                "swap_s": e.swap_s,
                "prefix_cache": e.sampler.settings.prefix_cache,
                "prefix": e.prefix_stats.as_dict(),
                "prefill_s": e.sampler.prefill_s,
                "prefill_trace_s": e.sampler.prefill_trace_s,
                "warm_up_s": e.sampler.warm_up_s,
                "compilations": e.sampler.compilations,
                "engine_failures": e.failures,
                "process_cpu_s": time.process_time(),  # this server's CPU seconds, all threads, since it started
                "weights_from": self.weights_from,
                "store_error": self.store_error,
                "store_fallback": self.store_fallback,
            }
        )

    async def get_metrics(self, request: HttpRequest) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def models(self, request: HttpRequest) -> JSONResponse:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "composer-jax",
                        "max_model_len": self.max_len,
                        "policy_version": self.engine.version,
                    }
                ],
            }
        )

    # ------------------------------------------------------------------ generation
    async def completions(self, request: HttpRequest) -> Response:
        return await self._generate(request, api.parse_completion, "cmpl", "text_completion")

    async def chat(self, request: HttpRequest) -> Response:
        return await self._generate(request, api.parse_chat, "chatcmpl", "chat.completion")

    async def _generate(
        self, request: HttpRequest, parse: Callable[..., Generation], prefix: str, obj: str
    ) -> Response:
        try:
            body = await self._body(request)
            t0 = time.perf_counter()
            try:
                gen = parse(body, tok=self.tok, served=self.model_name, max_len=self.max_len, vocab=self.vocab)
            finally:
                self.metrics.tokenize_seconds.inc(time.perf_counter() - t0)
        except ApiError as e:
            return _error(e)
        rid = f"{prefix}-{secrets.token_hex(12)}"
        reqs = [
            Request(gen.prompts[c // gen.n], p, id=f"{rid}-{c}")
            for c, p in enumerate(gen.params)  # choice c: prompt c // n
        ]
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def listener(ev: Event) -> None:  # called on the engine thread
            loop.call_soon_threadsafe(events.put_nowait, ev)

        try:
            self.engine.submit(reqs, listener, stream=gen.stream)
        except EngineFull as e:
            retry = str(RETRY_AFTER_S)  # about one request's decode: slots free up at that pace
            return _error(
                ApiError(429, f"the server is full: {e}; retry in {retry} s", code="queue_full"), {"Retry-After": retry}
            )
        except EngineStopped as e:
            return _error(ApiError(503, str(e), code="shutting_down"))
        ids = [r.id for r in reqs]
        if gen.stream:
            return StreamingResponse(
                self._stream(gen, rid, STREAM_OBJECT[obj], ids, events),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await self._collect(gen, rid, obj, ids, events)

    async def _collect(self, gen: Generation, rid: str, obj: str, ids: list[str], events: asyncio.Queue) -> Response:
        index = {r: c for c, r in enumerate(ids)}
        choices: dict[int, dict] = {}
        failure: Event | None = None
        try:
            while len(choices) < len(ids):
                ev = await events.get()
                if ev.error is not None:
                    failure = ev
                    break
                c, done = index[ev.request_id], ev.completion
                if done is None:
                    continue
                t0 = time.perf_counter()
                choices[c] = api.completion_choice(gen, c, self.tok, done, f"call_{rid[-8:]}_{c}")
                self.metrics.tokenize_seconds.inc(time.perf_counter() - t0)
        finally:
            pending = [r for c, r in enumerate(ids) if c not in choices]
            if pending:
                self.engine.cancel(pending)
        if failure is not None:
            return _error(ApiError(failure.status, failure.error or "", code="engine_error"))
        if gen.prompt_logprobs:
            await self._add_prompt_logprobs(gen, choices)
        completion_tokens = sum(len(ch["token_ids"]) for ch in choices.values())
        t0 = time.perf_counter()
        answer = JSONResponse(  # (encoded here: the body is rendered by the constructor)
            {
                "id": rid,
                "object": obj,
                "created": int(time.time()),
                "model": gen.model,
                "choices": [choices[c] for c in range(len(ids))],
                "usage": api.usage(sum(len(p) for p in gen.prompts), completion_tokens),
                **api.response_fields(gen),
            }
        )
        self.metrics.http_seconds.inc(time.perf_counter() - t0)
        return answer

    async def _add_prompt_logprobs(self, gen: Generation, choices: dict[int, dict]) -> None:
        """vLLM's `prompt_logprobs` on every choice: a forward pass of the served weights (read now;
        a swap since the choices were generated does not matter to a prompt's score) over each prompt,
        off the event loop."""
        params = self.engine.sampler.params
        fields = []
        for prompt in gen.prompts:
            logp, rank = await asyncio.to_thread(self.scorer, params, prompt)
            fields.append(prompt_logprobs_field(self.tok, prompt, logp, rank))
        for c, choice in choices.items():
            choice["prompt_logprobs"] = fields[c // gen.n]

    async def _stream(
        self, gen: Generation, rid: str, obj: str, ids: list[str], events: asyncio.Queue
    ) -> AsyncIterator[str]:
        index = {r: c for c, r in enumerate(ids)}
        created = int(time.time())
        choices = {c: ChoiceStream(self.tok, gen, c, f"call_{rid[-8:]}_{c}") for c in range(len(ids))}
        finished: set[int] = set()

        def chunk(body_choices: list[dict], **extra: Any) -> str:
            t0 = time.perf_counter()
            body = {"id": rid, "object": obj, "created": created, "model": gen.model, "choices": body_choices, **extra}
            text = f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
            self.metrics.http_seconds.inc(time.perf_counter() - t0)
            return text

        try:
            if gen.kind == "chat":
                first = [
                    {"index": c, "delta": {"role": "assistant", "content": ""}, "finish_reason": None} for c in choices
                ]
                yield chunk(first, **api.response_fields(gen))
            while len(finished) < len(ids):
                ev = await events.get()
                if ev.error is not None:
                    yield f"data: {json.dumps(ApiError(ev.status, ev.error, code='engine_error').body())}\n\n"
                    break
                c = index[ev.request_id]
                if ev.completion is not None:
                    finished.add(c)
                t0 = time.perf_counter()
                parts = choices[c].on_event(ev)
                self.metrics.tokenize_seconds.inc(time.perf_counter() - t0)
                for body_choice in parts:
                    yield chunk([body_choice])
            else:
                if gen.include_usage:
                    completion = sum(len(ch.tokens) for ch in choices.values())
                    yield chunk([], usage=api.usage(sum(len(p) for p in gen.prompts), completion))
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or the stream ended): free the slots still generating
            pending = [r for c, r in enumerate(ids) if c not in finished]
            if pending:
                self.engine.cancel(pending)

    # ------------------------------------------------------------------ admin
    async def load_weights(self, request: HttpRequest) -> Response:
        """{"checkpoint": DIR, "version": int (default current + 1; must exceed the current one),
        "step": int (training checkpoints; default latest), "source": "checkpoint"} -> the new
        version, once a decode step has run with it (requests in flight continue)."""
        try:
            body = await self._body(request)
            if not isinstance(body, dict):
                raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
            source = body.get("source", "checkpoint")
            if source not in SOURCES:
                raise ApiError(400, f"source: {source!r} is not accepted; accepted: {list(SOURCES)}", param="source")
            if source == "weight_store":
                return await self._load_from_store(body)
            path = body.get("checkpoint")
            if not isinstance(path, str) or not path:
                raise ApiError(
                    400, f"checkpoint: {path!r} is not accepted; accepted: a directory path", param="checkpoint"
                )
            step = api.int_field(body, "step", None, 0)
            if self.load_policy is None:
                raise ApiError(403, "this server was built without a weight loader", code="disabled")
            async with self._load_lock:
                current = self.engine.version
                version = api.int_field(body, "version", current + 1, current + 1)
                assert version is not None
                t0 = time.perf_counter()
                try:
                    policy = await asyncio.to_thread(self.load_policy, path, step)
                except (ConfigError, CheckpointError, ValueError, OSError) as e:
                    raise ApiError(
                        400, f"checkpoint {path!r}: {e}", param="checkpoint", code="bad_checkpoint"
                    ) from None
                params = self._matching(policy)
                load_s = time.perf_counter() - t0
                with _swap_errors(f"the weights of {path!r} failed in their first decode step", current):
                    previous = await asyncio.wrap_future(self.engine.update_weights(params, version))
                self.lora = policy.lora  # what the store's next versions are (adapters of that run, or models)
        except ApiError as e:
            return _error(e)
        return JSONResponse(
            {
                "version": version,
                "previous_version": previous,
                "checkpoint": path,
                "kind": policy.kind,
                "step": policy.step,
                "load_seconds": round(load_s, 3),
            }
        )

    async def _load_from_store(self, body: dict) -> JSONResponse:
        """{"source": "weight_store", "url": URL (default: the followed store), "version": N (default:
        the latest)} -> the version served afterwards. A version not newer than the served one is
        refused with 409 (versions only move forward); a bad copy in the store is replaced by the
        newest earlier good one (`fallback` in the answer) and is swapped in only when newer."""
        url = body.get("url", self.weights_from)
        if not isinstance(url, str) or "://" not in url:
            raise ApiError(
                400,
                f"url: {url!r} is not accepted; accepted: a weight-sync store URL (file://DIR, gs://..., s3://...)"
                + ("" if self.weights_from else "; this server follows no store, so url is required"),
                param="url",
            )
        async with self._load_lock:
            current = self.engine.version
            version = api.int_field(body, "version", None, 0)
            if version is not None and version <= current:  # e.g. it polled that version (or a newer) first
                raise ApiError(
                    409,
                    f"version {version} is not newer than the served version {current}; versions only move forward",
                    param="version",
                    code="not_newer",
                )
            t0 = time.perf_counter()
            with _swap_errors(f"version {version} of {url!r} failed in its first decode step", current):
                try:
                    got, previous = await self._swap_from_store(url, version)
                except WeightSyncError as e:
                    raise ApiError(400, f"weight store {url!r}: {e}", param="url", code="bad_weight_store") from None
        if previous is None:
            raise ApiError(
                409,
                f"the store's version {got.version} is not newer than the served version {current}"
                + (f" ({got.fallback})" if got.fallback else "")
                + "; versions only move forward",
                param="version",
                code="not_newer",
            )
        return JSONResponse(
            {
                "version": got.version,
                "previous_version": previous,
                "url": url,
                "source": "weight_store",
                "fallback": got.fallback,
                "load_seconds": round(time.perf_counter() - t0, 3),
            }
        )

    def _matching(self, policy: Policy) -> Any:
        """The loaded parameters in the served tree's dtypes; 409 when the architecture differs."""
        served = self.engine.sampler
        ours_cfg, theirs_cfg = {"model": to_dict(served.cfg)}, {"model": to_dict(policy.cfg)}
        diffs = config_differences(ours_cfg, theirs_cfg, ("model",), allowed=("model.name",))
        if diffs:
            listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in diffs[:8])
            raise ApiError(
                409,
                f"checkpoint {policy.path!r} is a different model than the served one ({listed}); "
                "only weights of the same architecture can be swapped in",
                param="checkpoint",
                code="model_mismatch",
            )
        ours: Any = jax.tree.structure(served.params)  # (jaxlib's PyTreeDef stub lacks __eq__)
        theirs: Any = jax.tree.structure(policy.params)
        if ours != theirs:
            raise ApiError(
                409, f"checkpoint {policy.path!r}: parameter tree differs from the served one", code="model_mismatch"
            )
        return jax.tree.map(lambda new, old: new.astype(old.dtype), policy.params, served.params)


class ChoiceStream:
    """One choice of a streamed response: its tokens so far and what was sent of them.

    Text is decoded incrementally (from a point where the decoded text ends on a whole character)
    and held back while it may still become a stop string; completion `text_offset`s count on from
    the characters of the tokens already sent; chat tool calls are sent as OpenAI deltas once each
    call is complete (`api.finished_calls`)."""

    def __init__(self, tok: Tokenizer, gen: Generation, index: int, call_id_prefix: str):
        self.tok, self.gen, self.index, self.call_id_prefix = tok, gen, index, call_id_prefix
        self.tokens: list[int] = []
        self.sent = ""  # the text sent so far
        self.decoded: tuple[int, str] = (0, "")  # (n, decoded text of the first n content tokens)
        self.offset = 0  # completions: characters of the tokens whose logprobs were sent
        self.calls_sent = 0  # chat: tool calls sent
        self.started = False  # a chunk of this choice was sent (completions' prompt ids go in the first)

    def on_event(self, ev: Event) -> list[dict]:
        """An engine event -> the choices of the chunks to send (the last one finishes the choice
        when the event carries the completion)."""
        done = ev.completion
        if done is None:
            self.tokens.extend(ev.tokens)
            calls = self._call_chunks(False) if self._closes_a_call(ev.tokens) else []
            return [self._delta(ev.tokens, ev.logprobs, ev.versions, final=False), *calls]
        n = len(self.tokens)
        self.tokens = list(done.tokens)
        last = self._delta(done.tokens[n:], done.logprobs[n:], done.versions[n:], final=True)
        out = []
        calls = self._call_chunks(True)
        if calls:  # content first, then the calls, then the finish (as OpenAI orders them)
            out = [last, *calls]
            last = self._empty()
        return [*out, self._finish(last, done)]

    def _text(self, final: bool) -> str:
        gen = self.gen
        toks = self.tokens if gen.kind == "completion" else api.chat_content_tokens(self.tok, gen.forced + self.tokens)
        n, head = self.decoded
        text = head + self.tok.decode(toks[n:], skip_special_tokens=True)
        if len(toks) - n >= 32 and not text.endswith("\ufffd"):
            self.decoded = (len(toks), text)
        return api.cut_at_stop(text, gen.stop)[0] if final else api.streamable(text, gen.stop)

    def _delta(self, new: list[int], lps: list[float], versions: list[int], final: bool) -> dict:
        text = self._text(final)
        piece = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent += piece
        choice: dict[str, Any] = {"index": self.index}
        if self.gen.kind == "completion":
            choice["text"] = piece
            choice["logprobs"] = self._completion_logprobs(new, lps) if self.gen.logprobs else None
        else:
            choice["delta"] = {"content": piece} if piece else {}
            choice["logprobs"] = api.chat_logprobs(self.tok, new, lps) if self.gen.logprobs else None
        choice["finish_reason"] = None
        choice["token_ids"] = [int(t) for t in new]
        choice["token_versions"] = [int(v) for v in versions]
        if not self.started:
            choice.update(api.prompt_ids_field(self.gen, self.index))
            self.started = True
        return choice

    def _completion_logprobs(self, new: list[int], lps: list[float]) -> dict:
        out = api.completion_logprobs(self.tok, new, lps, offset=self.offset)
        self.offset += sum(len(p) for p in out["tokens"])
        return out

    def _closes_a_call(self, new: list[int]) -> bool:
        """Whether `new` may complete a tool call (so the turn is read again only then, not at
        every token of a long turn)."""
        chat = chat_format(self.tok)
        ends = {*chat.call_start, *chat.call_end, *chat.end_of_turn}
        return any(t in ends for t in new)

    def _call_chunks(self, final: bool) -> list[dict]:
        """Chat: the deltas of the tool calls completed since the last call sent."""
        if self.gen.kind != "chat" or self.gen.tool_choice == "none":
            return []
        if final:
            calls = api.chat_turn(self.gen, self.tok, self.tokens, self.call_id_prefix).tool_calls
        else:
            calls = api.finished_calls(self.gen, self.tok, self.tokens, self.call_id_prefix)
        out = []
        for i in range(self.calls_sent, len(calls)):
            for d in api.tool_call_deltas(i, calls[i]):
                out.append({**self._empty(), "delta": {"tool_calls": [d]}})
        self.calls_sent = max(self.calls_sent, len(calls))
        return out

    def _empty(self) -> dict:
        delta_key = "text" if self.gen.kind == "completion" else "delta"
        return {
            "index": self.index,
            delta_key: "" if delta_key == "text" else {},
            "logprobs": None,
            "finish_reason": None,
            "token_ids": [],
            "token_versions": [],
        }

    def _finish(self, choice: dict, done: Any) -> dict:
        reason = done.finish_reason
        if self.gen.kind == "chat":
            turn = api.chat_turn(self.gen, self.tok, done.tokens, self.call_id_prefix)
            if turn.tool_calls and reason == "stop":
                reason = "tool_calls"
            choice["malformed_tool_calls"] = turn.malformed
        choice["finish_reason"] = reason
        if self.gen.return_routing:
            choice["routed_experts"] = api.routing_field(done.routing, len(done.prompt))
        if self.gen.return_prompt_routing:
            choice["prompt_routed_experts"] = api.prompt_routing_field(done.routing, len(done.prompt))
        return choice
