"""What the sampler's programs cost on this CPU: compiling each admission shape, a prefill row alone
and in a group, and a decode step by slot count (issue 53: why the demo's RL config admits one
prompt per program and its replicas hold 32 slots each).

For the tiny model (configs/model/tiny.yaml, random weights: the costs do not depend on them) and a
sampler of `--max-len` tokens, it prints:

- per admission shape (rows x prompt bucket): the seconds XLA takes to compile the program and the
  milliseconds one call takes (median of `--repeats`), with the milliseconds per prefilled token;
- per slot count: the milliseconds of one decode step (every slot active; a step costs the same
  whichever slots are busy, since the program runs all of them).

    PYTHONPATH=src .venv/bin/python bench/sampler_programs.py [--shapes 1x16,8x64,1x512,8x512] \
        [--slots 8,16,32,64] [--max-len 768] [--repeats 10]

Run it alone (`taskset -c 0` for one core, as a pinned replica has): the figures are wall times.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import composer_jax as cj
from composer_jax.config.sampler import SamplerConfig
from composer_jax.inference.engine.batch_sampler import Sampler

TINY = Path(__file__).resolve().parents[1] / "configs" / "model" / "tiny.yaml"


def _median_ms(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def admission(sampler: Sampler, rows: int, bucket: int, repeats: int) -> tuple[float, float]:
    """(compile seconds, ms per call) of the (rows, bucket) admission program, on padding rows
    (which write nothing, as `Sampler.warm_up` runs them)."""
    f32 = jnp.zeros(rows, jnp.float32)
    rest = (
        jnp.full(rows, sampler.slots, jnp.int32),
        jnp.zeros(rows, jnp.int32),
        jnp.zeros((rows, bucket), jnp.int32),
        jnp.full(rows, bucket, jnp.int32),
        f32,
        jnp.zeros(rows, jnp.int32),
        f32 + 1.0,
        jnp.zeros(rows, jnp.uint32),
    )
    t0 = time.perf_counter()
    program = sampler.programs.prefill_group.jitted.lower(sampler.params, sampler.cache, *rest).compile()
    compile_s = time.perf_counter() - t0

    def call():
        sampler.cache, *out = program(sampler.params, sampler.cache, *rest)  # the cache is donated
        return out

    call()
    return compile_s, _median_ms(call, repeats)


def decode_step(params, cfg, slots: int, max_len: int, repeats: int) -> float:
    """ms of one decode step of a `slots`-slot sampler, every slot active."""
    s = Sampler.from_config(params, cfg, SamplerConfig(slots=slots), max_len=max_len)
    ones = jnp.ones(slots, jnp.float32)
    zeros = jnp.zeros(slots, jnp.int32)
    rest = (zeros, jnp.ones(slots, bool), ones, zeros, ones, jnp.zeros(slots, jnp.uint32))
    program = s.programs.decode.jitted.lower(s.params, s.cache, *rest).compile()

    def call():
        s.cache, *out = program(s.params, s.cache, *rest)
        return out

    call()
    return _median_ms(call, repeats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1x16,16x32,1x64,8x64,1x128,8x128,1x512,8x512,1x768")
    ap.add_argument("--slots", default="4,8,16,32,64")
    ap.add_argument("--max-len", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    cfg = cj.load_config(TINY, num_devices=None).model
    params = cj.init_params(cfg, jax.random.key(0))
    slots = max(int(x) for x in args.slots.split(","))
    sampler = Sampler.from_config(params, cfg, SamplerConfig(slots=slots), max_len=args.max_len)
    print(f"tiny model, max_len {args.max_len}, {jax.devices()[0].platform}; admission programs (rows x bucket):")
    print("| shape | compile s | ms / call | ms / token |\n|---|---|---|---|")
    for shape in args.shapes.split(","):
        rows, bucket = (int(x) for x in shape.split("x"))
        compile_s, ms = admission(sampler, rows, bucket, args.repeats)
        print(f"| {rows} x {bucket} | {compile_s:.2f} | {ms:.1f} | {ms / (rows * bucket):.3f} |", flush=True)
    print("\ndecode step, every slot active:\n| slots | ms / step | ms / slot |\n|---|---|---|")
    for n in (int(x) for x in args.slots.split(",")):
        ms = decode_step(params, cfg, n, args.max_len, args.repeats)
        print(f"| {n} | {ms:.2f} | {ms / n:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
