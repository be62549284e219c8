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
        [--draft-experts 1,0]   (also draft with 1 routed expert / the shared expert only per token)

The floor (printed last): from this run's own routing (the greedy k = 0 tokens through the
training forward, main model and MTP module 1), the distinct experts a window of w = k + 1
consecutive tokens routes to per MoE layer against a 1-token step; from the parameter shapes, the
weights a plain step, a verify window, the MTP block (with the draft's experts per token) and a
draft head read (each distinct expert once) and the FLOPs of their matrix products as the decode
path runs them; then per speculative row the speed-up bound E[tokens per verify step] /
(cost(verify window) + cost(drafts)) / cost(plain step) under the weight-read model, the FLOP
model and the pieces' measured times (the main forward over k + 1 tokens and the draft program,
each compiled and timed alone), next to the measured speed-up; and the output head's matrix
product alone at 1 and w rows (same bytes).

Every row's speed-up is printed against two baselines: the plain sampler stepping one token per
call (decode_chunk=1, "k=0") and the plain sampler with 16 decode steps per compiled call
(decode_chunk=16, "k=0 c16", the engine's best plain mode). Speculative rows run with one verify
step per call ("c1") and with `--chunk` verify steps per call ("c16": the accept and stop
bookkeeping on device, `SamplerSettings(speculative_tokens=k, decode_chunk=16)`). Timed runs alternate
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


# ------------------------------------------------------------------------------------- the floor
def _nbytes(tree) -> int:
    import jax

    return int(sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def distinct_experts(routing: np.ndarray, start: int, w: int, n: int | None = None) -> float:
    """routing int[layers, batch, seq, k] (the k choices best first) -> the mean over layers,
    sequences and windows of w consecutive positions from `start` on of how many distinct experts
    the window's tokens route to, counting each token's first n choices (None: all k)."""
    layers, batch, seq, k = routing.shape
    r = routing[..., : (k if n is None else n)]
    if r.shape[-1] == 0:
        return 0.0
    counts = [
        len(np.unique(r[layer, b, p : p + w]))
        for layer in range(layers)
        for b in range(batch)
        for p in range(start, seq - w + 1)
    ]
    return float(np.mean(counts))


@dataclasses.dataclass
class Costs:
    """Weights one program reads (bytes, each distinct expert once) and the FLOPs of its matrix
    products as the decode path runs them (the "loop" MoE scheme runs a chosen expert on every
    token of the step)."""

    bytes: float = 0.0
    flops: float = 0.0

    def __add__(self, o: Costs) -> Costs:
        return Costs(self.bytes + o.bytes, self.flops + o.flops)

    def __mul__(self, c: float) -> Costs:
        return Costs(self.bytes * c, self.flops * c)


def cost_model(params, cfg, d_main: dict[int, float], d_mtp: dict[tuple[int, int], float]):
    """-> (main(w): the main model over w tokens, mtp(w, n): MTP module 1's block over w tokens
    with n routed experts per token, head(w, cols): the output head's `cols` columns on w tokens).
    d_main[w] / d_mtp[w, n]: mean distinct experts a w-token window reads per MoE layer."""
    from composer_jax.model.moe import decode as moe

    e, v = cfg.hidden_size, cfg.vocab_size
    f = lambda tree: 2 * _nbytes(tree) / 4  # FLOPs of a matrix-vector product per token (float32 weights)
    one_expert = _nbytes(_layer(params["moe_layers"]["moe"]["gate"])) // cfg.num_experts * 3
    expert_flops = 2 * one_expert / 4

    def moe_part(stack, w: int, distinct: float, k: int) -> Costs:
        m = stack["moe"]
        fixed = {
            key: m[key] for key in ("router", "router_bias", "shared_gate", "shared_up", "shared_down") if key in m
        }
        scheme = moe.decode_strategy(w, k, cfg.num_experts) if k else "loop"
        runs = w * distinct if scheme == "loop" else w * k  # expert MLPs run
        return Costs(_nbytes(fixed) + distinct * one_expert, w * f(fixed) + runs * expert_flops)

    def block(stack, w: int, distinct: float | None, k: int) -> Costs:
        rest = {key: val for key, val in stack.items() if key != "moe"}
        c = Costs(_nbytes(rest), w * f(rest))
        return c + (moe_part(stack, w, distinct, k) if distinct is not None else Costs())

    per_layer = _layer
    n_dense = params["dense_layers"]["attn"]["q_a"].shape[0] if "dense_layers" in params else 0
    n_moe = params["moe_layers"]["attn"]["q_a"].shape[0]

    def main(w: int) -> Costs:
        c = Costs(w * e * 4, 0) + head(w, v)  # embedding rows, the head
        if n_dense:
            c = c + block(per_layer(params["dense_layers"]), w, None, 0) * n_dense
        return c + block(per_layer(params["moe_layers"]), w, d_main[w], cfg.num_experts_per_tok) * n_moe

    def mtp(w: int, n: int) -> Costs:
        mp = per_layer(params["mtp"])
        top = {key: val for key, val in mp.items() if key != "layer"}
        c = Costs(_nbytes(top) + w * e * 4, w * f(top))
        layer = dict(mp["layer"])
        if n == 0:  # shared expert only: a dense SwiGLU
            m = layer.pop("moe")
            layer["mlp"] = {key: m[key] for key in ("shared_gate", "shared_up", "shared_down")}
            return c + block(layer, w, None, 0)
        return c + block(layer, w, d_mtp[w, n], n)

    def head(w: int, cols: int) -> Costs:
        return Costs(e * cols * 4, 2 * w * e * cols)

    return main, mtp, head


def _layer(tree):
    """One layer of a stacked tree, as shapes (nothing is read)."""
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), tree)


def _median_ms(fn, *args, repeats: int = 20) -> float:
    """Median CPU ms (the process's, XLA's threads included: little disturbed by other jobs on a
    shared machine) of fn(*args), a jitted function, after one warm-up call."""
    import jax

    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.process_time()
        jax.block_until_ready(fn(*args))
        ts.append(time.process_time() - t0)
    return float(np.median(ts)) * 1e3


def floor(params, cfg, prompts, runs, rows, cost, frequent, args, log) -> None:
    """The speed-up bound of each speculative row under a weight-read and a FLOP cost model, from
    this run's own routing, next to the measured speed-up (module docstring: "The floor")."""
    import jax
    import jax.numpy as jnp

    from composer_jax.inference.engine.draft_verify import draft, draft_head_columns
    from composer_jax.model.kv_cache import init_cache
    from composer_jax.model.transformer import forward, output_head

    k_model = cfg.num_experts_per_tok
    # the routing of the greedy k = 0 run's tokens (prompt + generated), main model and MTP module 1
    seqs = jnp.asarray([p + t for p, t in zip(prompts, runs[0.0, 0, 0, 1, None][2])], jnp.int32)
    out = jax.jit(lambda p, s: forward(p, s, cfg))(params, seqs)
    routing = np.asarray(out.routing)  # [moe layers, batch, seq, k], best choice first
    mtp_routing = np.asarray(out.mtp_routing)[:, :, :-1]  # the last position has no next token
    start = args.prompt - 1  # a verify window starts at the slot's last token
    spec_rows = [r for r in rows if r[1]]
    windows = sorted({1} | {r[1] + 1 for r in spec_rows})
    ns = sorted({k_model if r[4] is None else r[4] for r in spec_rows})
    d_main = {w: distinct_experts(routing, start, w) for w in windows}
    d_mtp = {(w, n): distinct_experts(mtp_routing, start, w, n) for w in windows for n in ns if n}
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    main, mtp, head = cost_model(shapes, cfg, d_main, d_mtp)
    plain = main(1)

    # the drafts' program alone (MTP module 1 over a window of k + 1 tokens, k heads, k - 1 chained)
    t_draft = {}
    ids = jnp.asarray(frequent, jnp.int32)
    columns = {len(frequent): (ids, draft_head_columns(params, cfg, ids)), 0: None}
    one = lambda x, dt: jnp.full((1,), x, dt)
    for _, k, vocab, _, n, *_ in spec_rows:
        if (k, vocab, n) in t_draft:
            continue
        mtp_cache = init_cache(cfg, 1, args.prompt + args.new + 2 * k + 8, mtp_modules=1)
        mtp_cache = dataclasses.replace(mtp_cache, lengths=one(args.prompt, jnp.int32))
        hidden = jax.random.normal(jax.random.key(0), (1, k + 1, cfg.hidden_size), jnp.float32)
        nxt = jnp.asarray(seqs[:1, args.prompt : args.prompt + k + 1])
        fn = jax.jit(
            lambda p, c, h, t, dh, k=k, n=n: draft(
                p,
                cfg,
                c,
                h,
                t,
                one(args.prompt + k + 1, jnp.int32),
                k,
                one(1.0, jnp.float32),
                one(0, jnp.int32),
                one(1.0, jnp.float32),
                one(0, jnp.uint32),
                None,
                dh,
                n,
            )
        )
        t_draft[k, vocab, n] = _median_ms(fn, params, mtp_cache, hidden, nxt, columns[vocab])

    mb = lambda c: c.bytes / 2**20
    print(
        "\nTHE FLOOR: what a plain step, a verify window and the drafts read, batch 1, from this run's routing"
        "\n(the greedy k = 0 tokens through the training forward; windows of w consecutive tokens from the"
        "\nprompt's last on, the verify window's tokens when every draft is accepted). Weights in MiB read once"
        "\nper program (each distinct expert once; the KV cache, <0.1 MiB here, left out); FLOPs of the matrix"
        "\nproducts as the decode path runs them ('loop' MoE: a chosen expert runs on all w tokens)."
    )
    print(
        f"  plain step (1 token): {k_model} experts / MoE layer, {mb(plain):.1f} MiB "
        f"({mb(head(1, cfg.vocab_size)):.1f} of them the output head), {plain.flops / 1e6:.0f} MFLOP; "
        f"measured {cost[1]:.2f} CPU ms"
    )
    for w in windows[1:]:
        c = main(w)
        print(
            f"  verify window of {w} tokens: {d_main[w]:.2f} distinct experts / MoE layer (1 token: {d_main[1]:.2f}), "
            f"{mb(c):.1f} MiB = {c.bytes / plain.bytes:.2f}x, "
            f"{c.flops / 1e6:.0f} MFLOP = {c.flops / plain.flops:.2f}x; "
            f"measured {cost[w]:.2f} CPU ms = {cost[w] / cost[1]:.2f}x"
        )
    for n in ns:
        for w in windows:
            c = mtp(w, n)
            de = f"{d_mtp[w, n]:.2f} distinct experts" if n else "shared expert only"
            print(
                f"  MTP block, {n} routed experts / token, over {w} tokens: {de}, {mb(c):.2f} MiB, "
                f"{c.flops / 1e6:.1f} MFLOP"
            )
    print(
        f"  draft head: {mb(head(1, len(frequent))):.2f} MiB for {len(frequent)} columns, "
        f"{mb(head(1, cfg.vocab_size)):.1f} for all"
    )
    # the same weights read by 1 and by w rows: the output head's matrix product alone
    w_head = output_head(params, cfg)
    head_ms = {
        w: _median_ms(jax.jit(lambda x, m: x @ m), jnp.ones((w, cfg.hidden_size), jnp.float32), w_head) for w in windows
    }
    print(
        "  the output head's product alone (the same weights, read once): "
        + ", ".join(
            f"{w} rows {t:.2f} CPU ms ({t / head_ms[1]:.2f}x; {head(1, cfg.vocab_size).bytes / t / 1e6:.0f} GB/s, "
            f"{head(w, cfg.vocab_size).flops / t / 1e6:.0f} GFLOP/s)"
            for w, t in head_ms.items()
        )
        + "\n  (on XLA:CPU a 1-row product runs as a matrix-vector kernel at memory speed, 2+ rows as a"
        "\n  matrix-matrix kernel that is not: the verify window pays in time what it does not in bytes)"
    )
    print(
        "\nBound = tokens per verify step / (cost of a speculative step / cost of a plain step), a speculative"
        "\nstep = verify window of k + 1 + MTP block over it + k draft heads + k - 1 chained MTP blocks;"
        "\n'pieces': the main forward over k + 1 tokens + the draft program, each timed alone (CPU ms); 'at 100%':"
        "\nthe bytes bound if every draft were accepted; 'need': tokens / step the bytes model needs for 1.6x."
    )
    print(
        "T   | k | vocab | experts | tokens/step | bytes x | bound bytes | at 100% | need | FLOPs x | bound FLOPs "
        "| draft ms | pieces x | bound pieces | measured cpu vs c1 | vs c16"
    )
    for t, k, vocab, chunk, n, _, ups, _, tpv, _ in spec_rows:
        nn = k_model if n is None else n
        cols = vocab or cfg.vocab_size
        step = main(k + 1) + mtp(k + 1, nn) + head(1, cols) * k + (mtp(1, nn) + Costs()) * (k - 1)
        rb, rf = step.bytes / plain.bytes, step.flops / plain.flops
        rp = (cost[k + 1] + t_draft[k, vocab, n]) / cost[1]
        print(
            f"{t:3.1f} | {k} | {cols:5d} | {nn:7d} | {tpv:11.2f} | {rb:6.2f}x | {tpv / rb:10.2f}x | "
            f"{(k + 1) / rb:6.2f}x | "
            f"{1.6 * rb:4.2f} | {rf:6.2f}x | {tpv / rf:10.2f}x | {t_draft[k, vocab, n]:8.2f} | {rp:7.2f}x | "
            f"{tpv / rp:11.2f}x | {ups[1]:17.2f}x | {ups[3]:5.2f}x   (c{chunk})"
        )
    log("")


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
    ap.add_argument(
        "--draft-experts",
        default="",
        help="also run the drafts with these routed experts per token in the MTP block "
        "(SamplerSettings(draft_experts=n); 0 = its shared expert only), e.g. 2,1,0; empty: the model's own only",
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

    from composer_jax.hf.config import model_config_from_hf
    from composer_jax.inference.engine.batch_sampler import Request, Sampler, SamplerSettings
    from composer_jax.inference.engine.draft_verify import SpecStats
    from composer_jax.inference.engine.token_sampling import SamplingParams

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
    experts: list[int | None] = [None] + [int(n) for n in args.draft_experts.split(",") if n]
    settings: list[tuple[int, int, int, int | None]] = [(0, 0, 1, None), (0, 0, args.chunk, None)]
    settings += [(k, vocab, chunk, n) for n in experts for vocab in vocabs for chunk in spec_chunks for k in ks]
    temperatures = (0.0, 1.0)
    # every setting is compiled and warmed up first, then the timed runs go round-robin over the
    # settings, so a change in the machine's load hits all of them alike (medians over repeats)
    runs: dict[tuple[float, int, int, int, int | None], tuple] = {}
    one_slot = SamplerSettings(slots=1, max_len=max_len)
    for k, vocab, chunk, n in settings:
        variant = dataclasses.replace(
            one_slot,
            speculative_tokens=k,
            draft_vocab=frequent if vocab else None,
            decode_chunk=chunk,
            draft_experts=n,
        )
        sampler = Sampler(params, cfg, variant)
        for temperature in temperatures:
            reqs = [
                Request(p, SamplingParams(temperature=temperature, max_tokens=args.new, seed=i))
                for i, p in enumerate(prompts)
            ]
            runs[temperature, k, vocab, chunk, n] = (sampler, reqs, [c.tokens for c in sampler.run(reqs)])
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
        base, base_cpu, _, base_tokens = result[temperature, 0, 0, 1, None]
        chunked, chunked_cpu, _, _ = result[temperature, 0, 0, args.chunk, None]
        for k, vocab, chunk, n in settings:
            tps, c, st, first = result[temperature, k, vocab, chunk, n]
            same = np.mean([a == b for a, b in zip(first, base_tokens)])
            ups = (tps / base, base_cpu / c, tps / chunked, chunked_cpu / c)
            rows.append((temperature, k, vocab, chunk, n, tps, ups, st.acceptance_rate, st.tokens_per_step, same))

    # what one step costs: a verify of k + 1 tokens against a 1-token decode (main model only)
    from composer_jax.model.kv_cache import init_cache
    from composer_jax.model.transformer import forward_cached

    fwd = jax.jit(lambda p, t, c: forward_cached(p, t, cfg, c).logits)
    cache = init_cache(cfg, 1, max_len + 8)
    cache = dataclasses.replace(cache, lengths=jnp.full((1,), args.prompt, jnp.int32))
    cost = {}
    for w in sorted({1} | {k + 1 for k in ks}):
        toks = jnp.zeros((1, w), jnp.int32)
        cost[w] = _median_ms(fwd, params, toks, cache)

    print(
        "\nspeed-up against k = 0 with one decode step per call ('vs c1') and against k = 0 with"
        f" {args.chunk} decode steps per call ('vs c{args.chunk}'), in wall time and in CPU time (less disturbed"
        "\nby other jobs); 'cN' after k: N decode / verify steps per compiled call."
    )
    print(
        f"\nT   | k       | draft vocab | draft experts | tok/s | vs c1 wall | vs c1 cpu | vs c{args.chunk} wall | "
        f"vs c{args.chunk} cpu | acceptance per depth | tokens/step | ms/step | same tokens as k=0"
    )
    for t, k, vocab, chunk, n, tps, ups, acc, tpv, same in rows:
        accs = " ".join(f"{a:.2f}" for a in acc) if k else "-"
        v = "-" if not k else (str(vocab) if vocab else "all")
        per = tpv if k else 1.0
        name = f"{k} c{chunk}"
        ne = "-" if not k else str(cfg.num_experts_per_tok if n is None else n)
        print(
            f"{t:3.1f} | {name:7s} | {v:11s} | {ne:13s} | {tps:5.0f} | {ups[0]:9.2f}x | {ups[1]:8.2f}x | "
            f"{ups[2]:9.2f}x | {ups[3]:8.2f}x | {accs:20s} | {per:11.2f} | {1e3 * per / tps:7.1f} | {same:.0%}"
        )
    print(
        "\nmain-model forward over the cache, batch 1 (CPU ms): "
        + ", ".join(f"{w} tokens {c:.2f}" for w, c in cost.items())
    )
    floor(params, cfg, prompts, runs, rows, cost, frequent, args, log)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
