"""Prometheus text-format metrics for the environment server (no client library needed).

Counters and gauges are keyed by (name, sorted label items); histograms keep cumulative bucket
counts as the exposition format (version 0.0.4) requires.
"""

from __future__ import annotations

import threading
from collections import defaultdict

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_HELP = {
    "cj_env_sessions_active": ("gauge", "Sessions currently open."),
    "cj_env_sessions_created_total": ("counter", "Sessions created."),
    "cj_env_sessions_closed_total": ("counter", "Sessions closed, by reason (client, ttl, shutdown)."),
    "cj_env_sessions_rejected_total": ("counter", "Session creations refused because the server was full."),
    "cj_env_tool_calls_total": ("counter", "Tool calls, by tool and outcome (ok, error)."),
    "cj_env_tool_call_seconds": ("histogram", "Tool call duration in seconds, by tool."),
    "cj_env_grades_total": ("counter", "Gradings run."),
    "cj_env_grade_seconds": ("histogram", "Grading duration in seconds."),
    "cj_env_session_create_seconds": ("histogram", "Session creation latency in seconds."),
    "cj_env_http_requests_total": ("counter", "HTTP requests, by status code class."),
}


def _labels(items: tuple) -> str:
    if not items:
        return ""
    body = ",".join(
        f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"' for k, v in items
    )
    return "{" + body + "}"


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, dict[tuple, float]] = defaultdict(dict)
        self._hist: dict[str, dict[tuple, list]] = defaultdict(dict)

    def inc(self, name: str, value: float = 1.0, **labels) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[name][key] = self._values[name].get(key, 0.0) + value

    def set(self, name: str, value: float, **labels) -> None:
        with self._lock:
            self._values[name][tuple(sorted(labels.items()))] = float(value)

    def observe(self, name: str, seconds: float, **labels) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            h = self._hist[name].setdefault(key, [[0] * len(LATENCY_BUCKETS), 0.0, 0])
            for i, bound in enumerate(LATENCY_BUCKETS):
                if seconds <= bound:
                    h[0][i] += 1
            h[1] += seconds
            h[2] += 1

    def value(self, name: str, **labels) -> float:
        return self._values[name].get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> str:
        lines = []
        with self._lock:
            for name, (kind, help_) in _HELP.items():
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
                if kind == "histogram":
                    for key, (buckets, total, count) in sorted(self._hist.get(name, {}).items()):
                        for bound, n in zip(LATENCY_BUCKETS, buckets):
                            lines.append(f"{name}_bucket{_labels(key + (('le', bound),))} {n}")
                        lines.append(f"{name}_bucket{_labels(key + (('le', '+Inf'),))} {count}")
                        lines.append(f"{name}_sum{_labels(key)} {total:.6f}")
                        lines.append(f"{name}_count{_labels(key)} {count}")
                else:
                    for key, v in sorted(self._values.get(name, {}).items()):
                        lines.append(f"{name}{_labels(key)} {v:g}")
        return "\n".join(lines) + "\n"
