"""The sampler section: one continuous-batching sampler's settings, wherever a sampler runs.

One `SamplerConfig` feeds every surface (docs/inference.md): `composer-jax serve`'s flags
(`inference/server/cli.py` `add_sampler_flags` / `sampler_from_args`, defaults read from this class), the
learner's in-process sampler and the local replicas it starts (`rl.sampler`; the replicas' argv is
`sampler_argv` of the same object, so a setting cannot reach one surface and not the other) and
`Sampler.from_config`.

Example (YAML, the learner's section):

    rl:
      sampler:
        slots: 32              # sequences decoded together (requests in flight wait for a slot)
        max_queued: null       # requests waiting for a slot before 429; null = no bound
        prefix_cache: version  # none, version, keep
        warm_up: false         # compile every admission program before the first request
        poll_s: 0.2            # a replica following a weight store looks for a new version so often
        decode_chunk: 1        # decode steps per compiled call (the host records tokens between calls)
        admission_rows: null   # the most prompts one prefill program admits together (null: up to the slots)
        compile_cache: ""      # a directory of JAX's persistent compilation cache the sampler's programs
                               # are written to and read from ("" = none): replicas sharing one compile
                               # each program once between them
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from typing import Literal

from composer_jax.errors import ConfigError
from composer_jax.flags import int_at_least

# the sampler's prefix KV reuse (inference/engine/prefix_cache.py): never, within one weight version, across
# versions ("off" would read as a YAML boolean)
PrefixCacheMode = Literal["none", "version", "keep"]
PREFIX_CACHE_MODES: tuple[str, ...] = typing.get_args(PrefixCacheMode)


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """The defaults are `composer-jax serve`'s; the learner's differ where stated (`LEARNER_SAMPLER`)."""

    # sequences decoded together: the batch of every decode step and the KV cache's rows
    slots: int = 8
    # requests admitted beyond the slots, waiting for one; more get 429 (None: no bound)
    max_queued: int | None = 64
    # a finished request's KV reused as the prefix of a later prompt: "version" = computed with the
    # current weights only (exactly a fresh prefill), "keep" = across weight versions too, "none" = never
    prefix_cache: PrefixCacheMode = "version"
    # compile every admission program (power-of-two groups up to `slots` by power-of-two prompt
    # buckets up to the context) before the first request, so none waits for a compilation
    warm_up: bool = False
    # seconds between a replica's looks at the weight store it follows for a new version
    poll_s: float = 1.0
    # decode steps per compiled call: one on-device loop of up to this many steps, ending early once
    # every slot reached its max_tokens or a stop id (inference/engine/batch_sampler.py); requests join,
    # leave and see new weights between calls. The same tokens; fewer host round trips
    decode_chunk: int = 1
    # the most prompts one admission (prefill) program holds; its rows are a power of two up to this
    # (None: up to `slots`). Every (rows, prompt bucket) shape is a program compiled at its first use,
    # seconds each on a CPU: a cap of 1 leaves one program per bucket
    admission_rows: int | None = None
    # JAX's persistent compilation cache for the sampler's programs (every program of 0.1 s of
    # compiling or more): a directory, created if missing, or "" for none. Replicas given one directory
    # load what another compiled first (an admission program costs seconds to compile on a CPU)
    compile_cache: str = ""


SERVE_SAMPLER = SamplerConfig()  # `composer-jax serve`'s defaults

# The learner's sampler (`rl.sampler` defaults): a step's rollouts decode together (32 slots); the
# learner bounds its own requests (rl.max_groups_in_flight, the staleness bound), so its replicas
# must never answer 429 (no queue bound); and a new version should reach them within a fraction of
# a step (0.2 s; the trainer also tells them each version, polling is the fallback).
LEARNER_SAMPLER = SamplerConfig(slots=32, max_queued=None, poll_s=0.2)


def validate_sampler(s: SamplerConfig, prefix: str) -> None:
    """The section's checks; errors name `prefix`.KEY (e.g. rl.sampler.slots)."""
    if isinstance(s.slots, bool) or not isinstance(s.slots, int) or s.slots < 1:
        raise ConfigError(f"{prefix}.slots={s.slots!r}: expected an integer >= 1")
    q = s.max_queued
    if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 0):
        raise ConfigError(f"{prefix}.max_queued={q!r}: expected an integer >= 0, or null for no bound")
    if s.prefix_cache not in PREFIX_CACHE_MODES:
        raise ConfigError(
            f"{prefix}.prefix_cache={s.prefix_cache!r} is not accepted; accepted: one of "
            + ", ".join(repr(m) for m in PREFIX_CACHE_MODES)
        )
    if not isinstance(s.warm_up, bool):
        raise ConfigError(f"{prefix}.warm_up={s.warm_up!r}: expected true or false")
    p = s.poll_s
    if isinstance(p, bool) or not isinstance(p, int | float) or not math.isfinite(p) or not p > 0:
        raise ConfigError(f"{prefix}.poll_s={p!r}: expected seconds > 0")
    c = s.decode_chunk
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
        raise ConfigError(f"{prefix}.decode_chunk={c!r}: expected an integer >= 1 (decode steps per compiled call)")
    a = s.admission_rows
    if a is not None and (isinstance(a, bool) or not isinstance(a, int) or a < 1):
        raise ConfigError(f"{prefix}.admission_rows={a!r}: expected an integer >= 1, or null for up to the slots")
    if not isinstance(s.compile_cache, str):
        raise ConfigError(f'{prefix}.compile_cache={s.compile_cache!r}: expected a directory path, or "" for none')


# ------------------------------------------------------------------ the command-line surface
# `composer-jax serve`'s flag of each field; `add_sampler_flags` declares them, `sampler_argv` writes
# them for a replica the learner starts, `sampler_from_args` reads them back.
FLAGS = {
    "slots": "--slots",
    "max_queued": "--max-queued",
    "prefix_cache": "--prefix-cache",
    "warm_up": "--warm-up",
    "poll_s": "--poll-interval",
    "decode_chunk": "--decode-chunk",
    "admission_rows": "--admission-rows",
    "compile_cache": "--compile-cache",
}


def add_sampler_flags(p: argparse.ArgumentParser, defaults: SamplerConfig = SERVE_SAMPLER) -> None:
    """The sampler's flags on a command's parser, their defaults and help from `defaults`."""
    d = defaults
    p.add_argument(
        FLAGS["slots"],
        dest="slots",
        type=int_at_least(1),
        default=d.slots,
        help=f"sequences decoded together (default {d.slots})",
    )
    p.add_argument(
        FLAGS["max_queued"],
        dest="max_queued",
        type=int_at_least(0, none=True),
        default=d.max_queued,
        help=f"requests waiting for a slot before 429; none: no bound (default {d.max_queued})",
    )
    p.add_argument(
        FLAGS["prefix_cache"],
        dest="prefix_cache",
        choices=PREFIX_CACHE_MODES,
        default=d.prefix_cache,
        help="reuse a finished request's KV as the prefix of a later prompt: version (computed with the current "
        "weights only, so exactly a fresh prefill), keep (across weight versions too), none "
        f"(default {d.prefix_cache})",
    )
    p.add_argument(
        FLAGS["warm_up"],
        dest="warm_up",
        action=argparse.BooleanOptionalAction,
        default=d.warm_up,
        help="compile every admission program (power-of-two groups up to --slots by power-of-two prompt buckets up "
        "to --max-len) before serving, so no request waits for a compilation (a mesh sampler compiles at first use)",
    )
    p.add_argument(
        FLAGS["poll_s"],
        dest="poll_s",
        type=float,  # > 0 checked by the command (it names the flag and exits with status 2)
        default=d.poll_s,
        help=f"--weights-from: seconds between weight-store polls (default {d.poll_s:g})",
    )
    p.add_argument(
        FLAGS["decode_chunk"],
        dest="decode_chunk",
        type=int_at_least(1),
        default=d.decode_chunk,
        help="decode steps per compiled call (one on-device loop; requests join and leave between calls; the same "
        f"tokens, fewer host round trips) (default {d.decode_chunk})",
    )
    p.add_argument(
        FLAGS["admission_rows"],
        dest="admission_rows",
        type=int_at_least(1, none=True),
        default=d.admission_rows,
        help="the most prompts one prefill program admits together (its rows a power of two up to this; each "
        "rows x prompt-bucket shape is a program compiled at first use); none: up to --slots "
        f"(default {'none' if d.admission_rows is None else d.admission_rows})",
    )
    p.add_argument(
        FLAGS["compile_cache"],
        dest="compile_cache",
        default=d.compile_cache,
        metavar="DIR",
        help="JAX's persistent compilation cache for the sampler's programs (created if missing): replicas "
        "given one directory compile each program once between them (default: none)",
    )


def sampler_from_args(args: argparse.Namespace) -> SamplerConfig:
    """The SamplerConfig of parsed `add_sampler_flags` flags."""
    return SamplerConfig(**{name: getattr(args, name) for name in FLAGS})


def sampler_argv(s: SamplerConfig) -> list[str]:
    """`s` as the flags `add_sampler_flags` reads (sampler_from_args(parse(sampler_argv(s))) == s)."""
    return [
        FLAGS["slots"],
        str(s.slots),
        FLAGS["max_queued"],
        "none" if s.max_queued is None else str(s.max_queued),
        FLAGS["prefix_cache"],
        s.prefix_cache,
        FLAGS["warm_up"] if s.warm_up else "--no-warm-up",
        FLAGS["poll_s"],
        repr(float(s.poll_s)),
        FLAGS["decode_chunk"],
        str(s.decode_chunk),
        FLAGS["admission_rows"],
        "none" if s.admission_rows is None else str(s.admission_rows),
        FLAGS["compile_cache"],
        s.compile_cache,
    ]
