"""`composer-jax serve`'s Prometheus metrics (`GET /metrics`), through `prometheus_client`.

Each server has its own `CollectorRegistry` (tests start several servers in one process). Three
kinds of source, each chosen so that the decode loop does no metrics work of its own:

* HTTP requests, counted and timed by an ASGI wrapper around the whole app (`ObserveRequests`: 401s
  and 429s included), labelled by endpoint and status;
* the time to first token, observed by the engine's driver once per request, after the step that
  prefilled it (`Driver.first_token`; no work per decode step);
* the engine's state and the totals it keeps anyway (slots in use, waiting requests, generated and
  prompt tokens, weight version and swaps, steps, their seconds and the admissions' (prefill)
  seconds among them, failures), read when `/metrics` is scraped (`_EngineCollector`), so nothing
  is kept up to date in the hot path;
* where a request's time goes outside the engine, for the RL profile (runtime/profile.py): the seconds
  the handlers spend tokenising (parsing a request into token ids, building its answer's text,
  log-prob pieces and tool calls: `cj_serve_tokenize_seconds`) and on the HTTP side proper
  (JSON-decoding bodies, JSON-encoding answers - routed experts included: `cj_serve_http_seconds`),
  and the CPU seconds of the thread running the HTTP server's event loop
  (`cj_serve_http_thread_cpu_seconds`: all of the above plus the ASGI server's own parsing, which
  no handler sees).

Tokens per second is `rate(cj_serve_generation_tokens_total[1m])`; the gauge
`cj_serve_recent_generation_tokens_per_second` is the same rate over the time since the previous
scrape (at least `RATE_WINDOW_S` apart), for a quick look without PromQL. docs/inference.md lists
every metric.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from composer_jax.inference.engine.thread_engine import Engine

CONTENT_TYPE = CONTENT_TYPE_LATEST
# whole requests: a long RL rollout's completion can take minutes
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_WINDOW_S = 1.0  # the recent-rate gauge moves on scrapes at least this far apart
OTHER = "other"  # the endpoint label of paths that are no endpoint (bounded label values)


class ServeMetrics:
    """Every metric of one `serve` process, in its own registry; `endpoints`: the paths counted by
    name (others as "other")."""

    def __init__(self, engine: Engine, *, model_name: str, max_len: int, endpoints: Iterable[str]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.endpoints = frozenset(endpoints)
        self.requests = Counter(
            "cj_serve_requests", "HTTP requests, by endpoint and status code.", ["endpoint", "status"], registry=r
        )
        self.request_seconds = Histogram(
            "cj_serve_request_seconds",
            "HTTP request latency in seconds (to the end of the response: a stream's last chunk), by endpoint.",
            ["endpoint"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.first_token_seconds = Histogram(
            "cj_serve_time_to_first_token_seconds",
            "Seconds from a request's submission to the engine to its first token (queueing and prefill), per choice.",
            buckets=FIRST_TOKEN_BUCKETS,
            registry=r,
        )
        self.tokenize_seconds = Counter(
            "cj_serve_tokenize_seconds",
            "Seconds the request handlers spent tokenising: parsing requests into token ids (prompts, chat "
            "templates) and building answers from tokens (text, log-prob pieces, tool calls).",
            registry=r,
        )
        self.http_seconds = Counter(
            "cj_serve_http_seconds",
            "Seconds the request handlers spent JSON-decoding request bodies and JSON-encoding answers "
            "(stream chunks included).",
            registry=r,
        )
        Info("cj_serve_model", "The served model.", registry=r).info(
            {"model": model_name, "max_len": str(max_len), "slots": str(engine.sampler.slots)}
        )
        self.http_thread: int | None = None  # the event loop's thread (`watch_http_thread`)
        r.register(_EngineCollector(engine, self._http_thread_cpu))

    def watch_http_thread(self) -> None:
        """The calling thread (the HTTP server's event loop: call it from the app's lifespan) is the
        one whose CPU seconds `cj_serve_http_thread_cpu_seconds` reads."""
        self.http_thread = threading.get_ident()

    def _http_thread_cpu(self) -> float | None:
        if self.http_thread is None:
            return None
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self.http_thread))
        except (OSError, AttributeError):  # the thread ended; or a platform without per-thread clocks
            return None

    def endpoint(self, path: str) -> str:
        return path if path in self.endpoints else OTHER

    def render(self) -> bytes:
        """The exposition of every metric (`CONTENT_TYPE`), as the library writes it."""
        return generate_latest(self.registry)


class ObserveRequests:
    """ASGI wrapper (outermost, so refusals by the auth layer count too): every HTTP request is
    counted by endpoint and status and timed to the end of its response."""

    def __init__(self, app: Any, metrics: ServeMetrics):
        self.app, self.metrics = app, metrics
        # (path, status) -> (counter, histogram) children: `labels()` takes a lock and checks its
        # arguments on every call; endpoints and statuses are few (unknown paths share "other")
        self._series: dict[tuple[str, int], tuple[Any, Any]] = {}

    def _observe(self, path: str, status: int, seconds: float) -> None:
        series = self._series.get((path, status))
        if series is None:
            m, endpoint = self.metrics, self.metrics.endpoint(path)
            series = (m.requests.labels(endpoint, str(status)), m.request_seconds.labels(endpoint))
            if endpoint != OTHER:  # unknown paths are not cached one by one (a scan would grow it)
                self._series[(path, status)] = series
        series[0].inc()
        series[1].observe(seconds)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status: int | None = None
        outer = send

        async def send_(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await outer(message)

        try:
            await self.app(scope, receive, send_)
        finally:
            # no response started: an exception is on its way out, answered with a 500 by Starlette
            self._observe(scope.get("path", ""), 500 if status is None else status, time.perf_counter() - t0)


class _EngineCollector(Collector):
    """The engine's state and totals, read at scrape time (the engine thread keeps running: each
    value is read once, without a lock, so a scrape is a near-consistent snapshot)."""

    def __init__(self, engine: Engine, http_thread_cpu: Callable[[], float | None] = lambda: None):
        self.engine, self.http_thread_cpu = engine, http_thread_cpu
        self._lock = threading.Lock()
        self._last = (time.perf_counter(), engine.tokens_generated)  # (when, tokens) of the rate's start
        self._rate = 0.0

    def describe(self) -> Iterable[Metric]:
        return self._families(None)

    def collect(self) -> Iterable[Metric]:
        return self._families(self.engine)

    def _recent_rate(self, tokens: int) -> float:
        with self._lock:
            now = time.perf_counter()
            t, before = self._last
            if now - t >= RATE_WINDOW_S:
                self._rate = (tokens - before) / (now - t)
                self._last = (now, tokens)
            return self._rate

    def _families(self, e: Engine | None) -> list[Metric]:
        gauges = {
            "slots": "Decode slots (requests decoded together).",
            "slots_in_use": "Slots holding a request now.",
            "requests_waiting": "Requests in the engine waiting for a slot (the queue).",
            "weight_version": "Policy version of the weights being served.",
            "recent_generation_tokens_per_second": "Tokens generated per second since the previous scrape.",
        }
        counters = {
            "generation_tokens": "Tokens generated (every choice; cancelled requests' tokens included).",
            "prompt_tokens": "Prompt tokens admitted (every choice), prefilled or reused from the prefix cache.",
            "prompt_tokens_reused": "Prompt tokens reused from the prefix cache (not prefilled).",
            "weight_updates": "Weight versions swapped in (admin loads and weight-store polls).",
            "engine_steps": "Engine steps run (admissions and decode steps).",
            "engine_step_seconds": "Seconds spent inside engine steps (admissions and decode steps).",
            "prefill_seconds": "Seconds of the engine steps spent admitting requests: prefill, the first token "
            "(sampled inside the prefill program) and compilations; the rest of the steps' seconds decode "
            "(forward and sampling in one compiled program, and the tokens' recording).",
            "prefill_compile_seconds": "The part of the prefill seconds in admissions that compiled a new program "
            "(or loaded it from the persistent compilation cache).",
            "http_thread_cpu_seconds": "CPU seconds of the thread running the HTTP server's event loop (request "
            "parsing, handlers, tokenising, JSON; not the engine).",
            "engine_failures": "Engine steps that failed (their requests got a 500; the engine kept serving).",
        }
        families: dict[str, Any] = {k: GaugeMetricFamily(f"cj_serve_{k}", h) for k, h in gauges.items()}
        families |= {k: CounterMetricFamily(f"cj_serve_{k}", h) for k, h in counters.items()}
        if e is not None:
            sampler = e.sampler
            in_use, prefix, generated = sampler.slots_in_use, e.prefix_stats, e.tokens_generated
            values: dict[str, float] = {
                "slots": sampler.slots,
                "slots_in_use": in_use,
                "requests_waiting": max(e.outstanding - in_use, 0),
                "weight_version": e.version,
                "recent_generation_tokens_per_second": self._recent_rate(generated),
                "generation_tokens": generated,
                "prompt_tokens": prefix.reused + prefix.prefilled,
                "prompt_tokens_reused": prefix.reused,
                "weight_updates": e.swaps,
                "engine_steps": e.steps,
                "engine_step_seconds": e.step_s,
                "prefill_seconds": e.prefill_s,
                "prefill_compile_seconds": e.prefill_trace_s,
                "engine_failures": e.failures,
            }
            cpu = self.http_thread_cpu()
            if cpu is not None:
                values["http_thread_cpu_seconds"] = cpu
            for k, v in values.items():
                families[k].add_metric([], v)
        return list(families.values())


__all__ = ["CONTENT_TYPE", "ObserveRequests", "ServeMetrics"]
