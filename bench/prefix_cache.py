"""The sampler's prefix KV reuse on an agent-like multi-turn workload, one process, one core.

`--conversations` conversations run at once through one Sampler (`--slots` slots of `--max-len`),
in groups of `--group` that share their first prompt (as an RL group's rollouts do). A turn
generates `--turn-tokens` tokens on average (1/2 to 3/2 of it, by conversation); the next turn's
prompt is the whole conversation so far plus `--tool-tokens` tokens of tool output, submitted as
soon as the turn finishes, for `--turns` turns.
The model is the config's (seeded initialisation: timing does not depend on the weights), greedy
decoding with fixed lengths, so every mode runs exactly the same tokens.

For each prefix_cache mode ("none", "version"): one untimed pass (it compiles the programs the
workload meets), then `--repeats` timed passes alternating between the modes, each with new first
prompts (new tasks, so first turns miss). Printed per mode: wall seconds of a pass (median), seconds
in admissions (prefill, median), decode steps, prompt tokens prefilled and reused, hit rate, the
programs the untimed pass traced, those traced later (inside timed passes), and the untimed pass's
seconds (compilation included).

    PYTHONPATH=src python bench/prefix_cache.py [--config configs/rl/tiny_disable_debug.yaml]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def run_pass(sampler, args: argparse.Namespace, vocab: int, seed: int) -> dict:
    from composer_jax.inference.engine.batch_sampler import Request
    from composer_jax.inference.engine.token_sampling import SamplingParams

    rng = np.random.default_rng(seed)  # each pass its own first prompts (new tasks: first turns miss)
    # conversation c generates turn_tokens/2 .. 3 turn_tokens/2 tokens a turn: turns end at different steps
    params = [
        SamplingParams(temperature=0.0, max_tokens=args.turn_tokens // 2 + (7 * c) % (args.turn_tokens + 1))
        for c in range(args.conversations)
    ]
    firsts = [list(map(int, rng.integers(0, vocab, args.prompt))) for _ in range(args.conversations // args.group)]
    turns = {}
    for c in range(args.conversations):
        rid = sampler.submit(Request(firsts[c // args.group], params[c], id=f"c{c}-t0"))
        turns[rid] = 0
    prefill0, stats0 = sampler.prefill_s, sampler.prefix_stats.as_dict()
    steps, t0 = 0, time.perf_counter()
    while sampler.busy:
        steps += 1
        for done in sampler.step():
            c, t = done.id.split("-t")
            if int(t) + 1 < args.turns:
                tool = list(map(int, rng.integers(0, vocab, args.tool_tokens)))
                nxt = Request(done.prompt + done.tokens + tool, params[int(c[1:])], id=f"{c}-t{int(t) + 1}")
                sampler.submit(nxt)
    stats = sampler.prefix_stats.as_dict()
    return {
        "wall_s": time.perf_counter() - t0,
        "prefill_s": sampler.prefill_s - prefill0,
        "steps": steps,
        **{k: stats[k] - stats0[k] for k in ("admitted", "hits", "reused", "prefilled")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/rl/tiny_disable_debug.yaml", help="the model comes from this config")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--group", type=int, default=8, help="conversations sharing a first prompt")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=768)
    ap.add_argument("--prompt", type=int, default=300, help="first prompt tokens")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=48)
    ap.add_argument("--tool-tokens", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    need = args.prompt + args.turns * (args.turn_tokens * 3 // 2 + args.tool_tokens)
    if need > args.max_len:
        raise SystemExit(f"the longest conversation ({need} tokens) exceeds --max-len {args.max_len}")
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    import jax

    from composer_jax.config import load_config
    from composer_jax.inference.engine.batch_sampler import Sampler, SamplerSettings
    from composer_jax.model.params import init_params

    cfg = load_config(args.config, ["mesh.fsdp=1"], num_devices=None).model
    params = init_params(cfg, jax.random.key(0))
    modes = ("none", "version")
    samplers = {
        m: Sampler(params, cfg, SamplerSettings(slots=args.slots, max_len=args.max_len, prefix_cache=m)) for m in modes
    }
    compiled = {}
    untimed = {}
    for m in modes:
        t0 = time.perf_counter()
        run_pass(samplers[m], args, cfg.vocab_size, 0)
        untimed[m], compiled[m] = time.perf_counter() - t0, samplers[m].compilations
    passes: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.repeats):
        for m in modes:
            passes[m].append(run_pass(samplers[m], args, cfg.vocab_size, 1 + r))
    print(
        f"{args.conversations} conversations (groups of {args.group} sharing a {args.prompt}-token first prompt), "
        f"{args.turns} turns of {args.turn_tokens} generated + {args.tool_tokens} tool tokens, {args.slots} slots of "
        f"{args.max_len}, one core; medians of {args.repeats} passes after an untimed one"
    )
    print(
        f"{'prefix_cache':>12} {'wall s':>7} {'prefill s':>9} {'steps':>6} {'admitted':>8} {'hits':>5} "
        f"{'reused':>7} {'prefilled':>9} {'hit rate':>8} {'programs':>8} {'later':>5} {'first s':>8}"
    )
    for m in modes:
        p = passes[m]
        med = lambda k, p=p: statistics.median(x[k] for x in p)
        reused, prefilled = p[-1]["reused"], p[-1]["prefilled"]
        print(
            f"{m:>12} {med('wall_s'):7.2f} {med('prefill_s'):9.2f} {p[-1]['steps']:6d} {p[-1]['admitted']:8d} "
            f"{p[-1]['hits']:5d} {reused:7d} {prefilled:9d} {reused / max(reused + prefilled, 1):8.2f} "
            f"{compiled[m]:8d} {samplers[m].compilations - compiled[m]:5d} {untimed[m]:8.1f}"
        )


if __name__ == "__main__":
    main()
