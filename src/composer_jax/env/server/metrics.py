"""The environment server's Prometheus metrics, through `prometheus_client`.

Each server has its own `CollectorRegistry` (tests start several servers in one process; the
library's global registry would mix them). Events are counted where they happen (sessions, tool
calls, gradings, HTTP responses); state (sessions open, sandboxed commands running, built task
environments) is read from the objects that own it when `/metrics` is scraped (`_StateCollector`),
so the hot paths keep no gauge up to date. The names and labels are the ones the hand-written
exposition this replaces used; docs/env_protocol.md lists them all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class SandboxCounts(Protocol):
    """What `sandbox.SandboxStats` offers (read at scrape time)."""

    started: int
    running: int
    failed: dict[str, int]
    killed: dict[str, int]


class BuildCounts(Protocol):
    """What `pyenv.EnvCache` offers (read at scrape time)."""

    builds: dict[str, int]

    def counts(self) -> dict[str, int]: ...


class EnvMetrics:
    """Every metric of one environment server, in its own registry (`render` is the /metrics body)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.sessions_created = Counter("cj_env_sessions_created", "Sessions created.", registry=r)
        self.sessions_closed = Counter(
            "cj_env_sessions_closed",
            "Sessions closed, by reason (client, ttl, reset, shutdown).",
            ["reason"],
            registry=r,
        )
        self.sessions_rejected = Counter(
            "cj_env_sessions_rejected", "Session creations refused because the server was full.", registry=r
        )
        self.tool_calls = Counter(
            "cj_env_tool_calls", "Tool calls, by tool and outcome (ok, error).", ["tool", "outcome"], registry=r
        )
        self.tool_call_seconds = Histogram(
            "cj_env_tool_call_seconds",
            "Tool call duration in seconds, by tool.",
            ["tool"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.grades = Counter("cj_env_grades", "Gradings run.", registry=r)
        self.grade_cache_hits = Counter(
            "cj_env_grade_cache_hits", "Gradings answered from the grade cache (--grade-cache).", registry=r
        )
        self.grade_seconds = Histogram(
            "cj_env_grade_seconds", "Grading duration in seconds.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.session_create_seconds = Histogram(
            "cj_env_session_create_seconds", "Session creation latency in seconds.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.http_requests = Counter(
            "cj_env_http_requests", "HTTP requests, by status code class.", ["code"], registry=r
        )
        self._state: _StateCollector | None = None
        # labelled children by label values: `labels()` takes a lock and checks its arguments on
        # every call (~3x an increment); tool names and status classes are few, so each is looked
        # up once (a race only looks the same child up twice)
        self._tool_series: dict[tuple[str, bool], tuple[Any, Any]] = {}
        self._http_series: dict[int, Any] = {}

    def tool_call(self, tool: str, ok: bool, seconds: float) -> None:
        """One tool call: counted by tool and outcome, timed by tool."""
        series = self._tool_series.get((tool, ok))
        if series is None:
            series = self._tool_series[(tool, ok)] = (
                self.tool_calls.labels(tool=tool, outcome="ok" if ok else "error"),
                self.tool_call_seconds.labels(tool=tool),
            )
        series[0].inc()
        series[1].observe(seconds)

    def http_response(self, status: int) -> None:
        """One HTTP response, counted by its status class (2xx, 4xx, ...)."""
        klass = status // 100
        child = self._http_series.get(klass)
        if child is None:
            child = self._http_series[klass] = self.http_requests.labels(code=f"{klass}xx")
        child.inc()

    def watch(
        self,
        sessions: Callable[[], int],
        sandbox: SandboxCounts | None = None,
        env_cache: Callable[[], BuildCounts | None] | None = None,
    ) -> None:
        """Read the state gauges from these at every scrape: `sessions()` open sessions, the sandbox
        backend's counts, the task-environment cache (a callable: a server may set it later)."""
        if self._state is not None:
            self.registry.unregister(self._state)
        self._state = _StateCollector(sessions, sandbox, env_cache)
        self.registry.register(self._state)

    def render(self) -> bytes:
        """The exposition of every metric (`CONTENT_TYPE`), as the library writes it."""
        return generate_latest(self.registry)


class _StateCollector(Collector):
    """Gauges (and counters kept by their owners) read when scraped, not kept up to date."""

    def __init__(
        self,
        sessions: Callable[[], int],
        sandbox: SandboxCounts | None,
        env_cache: Callable[[], BuildCounts | None] | None,
    ):
        self.sessions, self.sandbox, self.env_cache = sessions, sandbox, env_cache

    def describe(self) -> Iterable[Metric]:
        return self._families(describe=True)

    def collect(self) -> Iterable[Metric]:
        return self._families(describe=False)

    def _families(self, describe: bool) -> list[Metric]:
        active = GaugeMetricFamily("cj_env_sessions_active", "Sessions currently open.")
        running = GaugeMetricFamily("cj_env_sandboxes_running", "Sandboxed commands running now.")
        created = CounterMetricFamily("cj_env_sandboxes_created", "Sandboxed commands started.")
        failed = CounterMetricFamily(
            "cj_env_sandboxes_failed",
            "Sandboxed commands whose sandbox did not come up, by reason (spawn: the launcher could not be "
            "executed; setup: bubblewrap refused to build the sandbox).",
            labels=["reason"],
        )
        killed = CounterMetricFamily(
            "cj_env_sandboxes_killed",
            "Sandboxed commands killed by a limit, by reason (timeout: the wall clock; output: output past "
            "64 times the returned cap; orphaned: a killed server's session uids whose processes were ended).",
            labels=["reason"],
        )
        envs = GaugeMetricFamily(
            "cj_env_environments",
            "Task Python environments known to the server, by state (built, failed).",
            labels=["state"],
        )
        builds = CounterMetricFamily(
            "cj_env_environment_builds",
            "Task Python environment builds this server ran, by outcome (ok, failed).",
            labels=["outcome"],
        )
        families: list[Any] = [active, running, created, failed, killed, envs, builds]
        if describe:
            return families
        active.add_metric([], self.sessions())
        if self.sandbox is not None:
            s = self.sandbox
            running.add_metric([], s.running)
            created.add_metric([], s.started)
            for reason, n in sorted(dict(s.failed).items()):
                failed.add_metric([reason], n)
            for reason, n in sorted(dict(s.killed).items()):
                killed.add_metric([reason], n)
        cache = self.env_cache() if self.env_cache is not None else None
        if cache is not None:
            for state, n in sorted(cache.counts().items()):
                envs.add_metric([state], n)
            for outcome, n in sorted(dict(cache.builds).items()):
                builds.add_metric([outcome], n)
        return families


__all__ = ["CONTENT_TYPE", "LATENCY_BUCKETS", "EnvMetrics"]
