"""Jitted programs that count their compilations where XLA compiles them.

A counter bumped inside the traced function counts traces, a side effect of tracing: a program
retraced for nothing, or compiled again without a retrace (new input shardings), counts wrong.
`CountedJit` counts instead the calls during which JAX asked XLA for an executable: JAX reports
every such request as the monitoring event `/jax/core/compile/backend_compile_duration` (emitted
around `compile_or_get_cached`, so a program loaded from the persistent compilation cache counts
too: it is a new executable for this process), in the thread that makes the call. A thread-local
stack of the calls in flight attributes each event to the innermost one, so programs of several
samplers in several threads count apart.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_local = threading.local()
_registered = False
_register_lock = threading.Lock()


def _on_duration_event(event: str, duration_secs: float, **kwargs: str | int) -> None:
    if event != BACKEND_COMPILE_EVENT:
        return
    calls = getattr(_local, "calls", None)
    if calls:
        calls[-1][0] = True


def _listen() -> None:
    global _registered
    with _register_lock:
        if not _registered:
            jax.monitoring.register_event_duration_secs_listener(_on_duration_event)
            _registered = True


class CountedJit:
    """`jax.jit(fn, donate_argnums=...)` with `compilations`: the calls that made XLA compile (or
    load) an executable for it, one per such call however many executables it needed."""

    def __init__(self, fn: Callable[..., Any], *, donate_argnums: int | Sequence[int] = ()):
        _listen()
        self.jitted = jax.jit(fn, donate_argnums=donate_argnums)
        self.compilations = 0

    def __call__(self, *args: Any) -> Any:
        calls = _local.__dict__.setdefault("calls", [])
        mark = [False]
        calls.append(mark)
        try:
            return self.jitted(*args)
        finally:
            calls.pop()
            if mark[0]:
                self.compilations += 1


def use_compile_cache(path: str) -> None:
    """Make `path` (created if missing) JAX's persistent compilation cache for this process, every
    program of 0.1 s of compiling or more written to it and read from it: processes given one
    directory (replicas of one run) compile a program once between them. For the compilations
    after it (a cache this process had opened before is closed)."""
    from jax.experimental.compilation_cache import compilation_cache

    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    if jax.config.values.get("jax_compilation_cache_dir") != path:
        jax.config.update("jax_compilation_cache_dir", path)
        compilation_cache.reset_cache()  # the next compilation opens `path`
