"""MTP speculative decoding speed-up at batch 1 on the shared reference model, MTP module trained.

The reference model (`../shared/bench/moe_bench_config.json`: 28M-parameter DeepSeek-V3-style MoE
with one MTP module) is initialised here and trained briefly, inside the bench, with the library's
own train step (`train.step.make_train_step`, pretraining objective with the MTP loss) on a narrow
synthetic corpus: code-like "lines" of 5-12 tokens from a fixed set of 32, each line followed by
one of 2 successors (probabilities 0.75 / 0.25), so most tokens are predictable from the ones
before and the MTP module learns the continuation quickly. No checkpoint is loaded.

Then, on prompts of 32 corpus tokens, 64 new tokens at batch 1: tokens/s of the sampler without
speculation and with k = 1..3 drafts (greedy, and sampled at temperature 1), the speed-up, the
acceptance rate per depth and the tokens per verify step. Also the cost of one verify step of
k + 1 tokens against a 1-token decode step, which bounds the speed-up.

    PYTHONPATH=src .venv/bin/python bench/speculative.py [--train-steps 120] [--repeats 5] [--threads 2]

Every row's speed-up is printed against two baselines: the plain sampler stepping one token per
call (decode_chunk=1, "k=0") and the plain sampler with 16 decode steps per compiled call
(decode_chunk=16, "k=0 c16", the engine's best plain mode). Speculative rows run with one verify
step per call ("c1") and with `--chunk` verify steps per call ("c16": the accept and stop
bookkeeping on device, `Sampler(speculative_tokens=k, decode_chunk=16)`). Timed runs alternate
over the settings; each row reports wall and CPU time (CPU time is less disturbed by other jobs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "bench" / "moe_bench_config.json"


class Corpus:
    """A Markov chain over `lines` fixed token sequences: after line i comes line succ[i][0] with
    probability 0.75, else succ[i][1]. Token ids are spread over the vocabulary."""

    def __init__(self, vocab: int, lines: int = 32, seed: int = 0):
        rng = np.random.default_rng(seed)
        words = rng.choice(np.arange(16, vocab), size=256, replace=False)
        self.lines = [words[rng.integers(0, len(words), rng.integers(5, 13))] for _ in range(lines)]
        self.succ = [rng.choice(lines, 2, replace=False) for _ in range(lines)]

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        out: list[int] = []
        line = int(rng.integers(len(self.lines)))
        while len(out) < n:
            out.extend(self.lines[line].tolist())
            line = int(self.succ[line][0 if rng.random() < 0.75 else 1])
        return np.asarray(out[:n], np.int32)


def train(cfg, corpus: Corpus, steps: int, batch: int, seq: int, lr: float, log):
    """The reference model from its init, trained `steps` steps with MTP loss; -> (params, how
    often each token id occurred in the training batches)."""
    import jax

    from composer_jax.config import Config, MeshConfig, OptimizerConfig, TrainConfig
    from composer_jax.sharding import ShardingRules, make_mesh
    from composer_jax.train.state import init_train_state
    from composer_jax.train.step import make_train_step

    run = Config(
        model=cfg,
        train=TrainConfig(
            seq_len=seq,
            batch_size=batch,
            steps=steps,
            mtp_weight=1.0,
            optimizer=OptimizerConfig(lr=lr, warmup_steps=10, schedule="constant"),
        ),
    )
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    rules = ShardingRules.create()
    state = init_train_state(run, mesh, rules)
    step = make_train_step(run, mesh, rules)
    rng = np.random.default_rng(1)
    counts = np.zeros(cfg.vocab_size, np.int64)
    t0 = time.perf_counter()
    for i in range(steps):
        tokens = np.stack([corpus.sample(seq, rng) for _ in range(batch)])
        counts += np.bincount(tokens.reshape(-1), minlength=cfg.vocab_size)
        b = {
            "tokens": tokens,
            "segment_ids": np.ones_like(tokens),
            "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), tokens.shape).copy(),
            "loss_mask": np.ones(tokens.shape, np.float32),
        }
        state, m = step(state, b)
        if i % 25 == 0 or i == steps - 1:
            log(
                f"  train step {i:4d}: nll {float(m['nll']):.3f} accuracy {float(m['accuracy']):.3f} "
                f"mtp accuracy {float(m['mtp_accuracy'][0]):.3f} ({time.perf_counter() - t0:.0f} s)"
            )
    return jax.device_get(state.params), counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train-steps", type=int, default=120)
    ap.add_argument("--train-batch", type=int, default=8)
    ap.add_argument("--train-seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per setting (median reported)")
    ap.add_argument("--prompts", type=int, default=4, help="batch-1 requests per timed run")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument(
        "--draft-vocab",
        type=int,
        default=1024,
        help="also draft over the N most frequent training tokens (FR-Spec); 0 = full vocabulary only",
    )
    ap.add_argument("--chunk", type=int, default=16, help="decode / verify steps per call of the chunked rows")
    ap.add_argument(
        "--spec-chunks", default="1,16", help="verify steps per call of the speculative rows (16 = --chunk)"
    )
    ap.add_argument(
        "--no-full-vocab", action="store_true", help="skip the speculative rows drafting over the whole vocabulary"
    )
    ap.add_argument("--reference", type=Path, default=REFERENCE, help="the reference model's config.json")
    ap.add_argument(
        "--threads", type=int, default=2, help="cores the process is pinned to (XLA sizes its pool from them)"
    )
    args = ap.parse_args(argv)
    if not args.reference.exists():
        print(f"bench/speculative.py: the reference config {args.reference} is missing", file=sys.stderr)
        return 2
    allowed = sorted(os.sched_getaffinity(0))
    if not 1 <= args.threads <= len(allowed):
        print(f"--threads {args.threads}: give 1..{len(allowed)} (this process's cores: {allowed})", file=sys.stderr)
        return 2
    os.sched_setaffinity(0, set(allowed[: args.threads]))  # before JAX sizes its thread pool
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import jax
    import jax.numpy as jnp

    from composer_jax.checkpoint.hf_config import model_config_from_hf
    from composer_jax.inference.sampler import Request, Sampler
    from composer_jax.inference.sampling import SamplingParams
    from composer_jax.inference.speculative import SpecStats

    fields = json.loads(args.reference.read_text())
    cfg, info = model_config_from_hf(fields)
    cfg = dataclasses.replace(cfg, num_mtp_layers=info.requested_mtp_layers)
    log = lambda s: print(s, flush=True)
    log(
        f"reference model: {cfg.num_layers} layers + {cfg.num_mtp_layers} MTP module, vocab {cfg.vocab_size}; "
        f"jax {jax.__version__} on {jax.devices()[0].platform}, pinned to cores {sorted(os.sched_getaffinity(0))}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    corpus = Corpus(cfg.vocab_size)
    log(f"training {args.train_steps} steps of {args.train_batch} x {args.train_seq} tokens (MTP loss weight 1)")
    trained, counts = train(cfg, corpus, args.train_steps, args.train_batch, args.train_seq, args.lr, log)
    params = jax.tree.map(jnp.asarray, trained)
    frequent = np.argsort(-counts, kind="stable")[: args.draft_vocab].tolist()

    rng = np.random.default_rng(123)
    prompts = [corpus.sample(args.prompt, rng).tolist() for _ in range(args.prompts)]
    max_len = args.prompt + args.new
    ks = [int(k) for k in args.ks.split(",")]
    spec_chunks = [int(c) for c in args.spec_chunks.split(",")]
    vocabs = ([] if args.no_full_vocab else [0]) + ([args.draft_vocab] if args.draft_vocab else [])
    settings = [(0, 0, 1), (0, 0, args.chunk)]
    settings += [(k, vocab, chunk) for vocab in vocabs for chunk in spec_chunks for k in ks]
    temperatures = (0.0, 1.0)
    # every setting is compiled and warmed up first, then the timed runs go round-robin over the
    # settings, so a change in the machine's load hits all of them alike (medians over repeats)
    runs: dict[tuple[float, int, int, int], tuple] = {}
    for k, vocab, chunk in settings:
        sampler = Sampler(
            params,
            cfg,
            slots=1,
            max_len=max_len,
            speculative_tokens=k,
            draft_vocab=frequent if vocab else None,
            decode_chunk=chunk,
        )
        for temperature in temperatures:
            reqs = [
                Request(p, SamplingParams(temperature=temperature, max_tokens=args.new, seed=i))
                for i, p in enumerate(prompts)
            ]
            runs[temperature, k, vocab, chunk] = (sampler, reqs, [c.tokens for c in sampler.run(reqs)])
    log(f"  compiled {len(settings)} samplers; timing (load average {os.getloadavg()[0]:.1f})")
    times: dict[tuple, list[float]] = {key: [] for key in runs}
    cpu: dict[tuple, list[float]] = {key: [] for key in runs}
    stats_by_key = {key: SpecStats.zeros(key[1]) for key in runs}
    for _ in range(args.repeats):
        for key, (sampler, reqs, _) in runs.items():
            sampler.spec_stats = stats_by_key[key]  # one sampler serves both temperatures: counts kept apart
            t0, c0 = time.perf_counter(), time.process_time()
            sampler.run(reqs)
            times[key].append(time.perf_counter() - t0)
            cpu[key].append(time.process_time() - c0)
    result = {}
    for key, (_, _, first) in runs.items():
        result[key] = (
            len(prompts) * args.new / float(np.median(times[key])),
            float(np.median(cpu[key])),
            stats_by_key[key],
            first,
        )
    rows = []
    for temperature in temperatures:
        base, base_cpu, _, base_tokens = result[temperature, 0, 0, 1]
        chunked, chunked_cpu, _, _ = result[temperature, 0, 0, args.chunk]
        for k, vocab, chunk in settings:
            tps, c, st, first = result[temperature, k, vocab, chunk]
            same = np.mean([a == b for a, b in zip(first, base_tokens)])
            ups = (tps / base, base_cpu / c, tps / chunked, chunked_cpu / c)
            rows.append((temperature, k, vocab, chunk, tps, ups, st.acceptance_rate, st.tokens_per_step, same))

    # what one step costs: a verify of k + 1 tokens against a 1-token decode (main model only)
    from composer_jax.model.kv_cache import init_cache
    from composer_jax.model.transformer import forward

    fwd = jax.jit(lambda p, t, c: forward(p, t, cfg, cache=c).logits)
    cache = init_cache(cfg, 1, max_len + 8)
    cache = dataclasses.replace(cache, lengths=jnp.full((1,), args.prompt, jnp.int32))
    cost = {}
    for n in sorted({1} | {k + 1 for k in ks}):
        toks = jnp.zeros((1, n), jnp.int32)
        fwd(params, toks, cache).block_until_ready()
        ts = []
        for _ in range(20):
            t0 = time.perf_counter()
            fwd(params, toks, cache).block_until_ready()
            ts.append(time.perf_counter() - t0)
        cost[n] = float(np.median(ts)) * 1e3

    print(
        "\nspeed-up against k = 0 with one decode step per call ('vs c1') and against k = 0 with"
        f" {args.chunk} decode steps per call ('vs c{args.chunk}'), in wall time and in CPU time (less disturbed"
        "\nby other jobs); 'cN' after k: N decode / verify steps per compiled call."
    )
    print(
        f"\nT   | k       | draft vocab | tok/s | vs c1 wall | vs c1 cpu | vs c{args.chunk} wall | "
        f"vs c{args.chunk} cpu | acceptance per depth | tokens/step | ms/step | same tokens as k=0"
    )
    for t, k, vocab, chunk, tps, ups, acc, tpv, same in rows:
        accs = " ".join(f"{a:.2f}" for a in acc) if k else "-"
        v = "-" if not k else (str(vocab) if vocab else "all")
        per = tpv if k else 1.0
        name = f"{k} c{chunk}"
        print(
            f"{t:3.1f} | {name:7s} | {v:11s} | {tps:5.0f} | {ups[0]:9.2f}x | {ups[1]:8.2f}x | {ups[2]:9.2f}x | "
            f"{ups[3]:8.2f}x | {accs:20s} | {per:11.2f} | {1e3 * per / tps:7.1f} | {same:.0%}"
        )
    print(
        "\nmain-model forward over the cache, batch 1 (ms): "
        + ", ".join(f"{n} tokens {c:.2f}" for n, c in cost.items())
    )
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
