"""`composer-jax demo`: the most complete real job on embedded defaults, runnable on a CPU laptop.

Default: Composer 2's continued-pretraining pipeline in miniature, on a fake 8-device CPU mesh:
the tiny DeepSeek-V3-style MoE's report, then stage 1 (bulk pretraining on this repository's code,
bundled BPE tokenizer), stage 2 (long-context extension: YaRN, context parallelism, MTP by
self-distillation) and stage 3 (SFT on agent conversations built from the bundled coding tasks and
from training seeds of the generated family disable-debug), each starting from the previous stage's
checkpoint; then asynchronous RL (`composer-jax rl`'s learner, configs/rl/tiny_disable_debug.yaml with
`async_overrides`: a sampler replica and environment servers as local processes) on new seeds of
disable-debug, with the held-out evaluation (seeds 1000000.., never trained on) before and after;
then a per-stage summary.

Everything goes under --out (default runs/demo in the current directory); the configs, tokenizer,
SFT sets and tasks are the bundled ones (composer_jax.resources: a checkout's, or an installed
wheel's copy), so the demo runs from any directory.

`--quick`: a few sharded AdamW steps on a synthetic rule (t_{i+1} = 5 t_i + 7 mod V), in a minute.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

if "jax" not in sys.modules:  # a fake multi-device CPU mesh must be requested before JAX starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import composer_jax as cj  # noqa: E402
from composer_jax import resources  # noqa: E402
from composer_jax.errors import UsageError  # noqa: E402
from composer_jax.inspection import build_report, format_report  # noqa: E402
from composer_jax.model.masks import segment_positions  # noqa: E402
from composer_jax.model.params import count_params, param_specs  # noqa: E402
from composer_jax.report import format_trend, time_line, trend  # noqa: E402
from composer_jax.rl.evaluate import format_paired  # noqa: E402
from composer_jax.train.state import init_train_state  # noqa: E402
from composer_jax.train.step import batch_sharding, make_train_step  # noqa: E402

CONFIG = ("model", "tiny.yaml")  # under the bundled configs/ (resources.data_path)
DEFAULT_OVERRIDES = ["mesh.data=2", "mesh.fsdp=2", "mesh.expert=2"]


def synthetic_batch(key: jax.Array, batch: int, seq: int, vocab: int):
    """Packed rows of two segments each following t_{i+1} = (5 t_i + 7) mod vocab from a random
    start: a deterministic bigram rule the model can learn in a few dozen steps."""
    starts = jax.random.randint(key, (batch, 2), 0, vocab)
    half = seq // 2

    def run(t0):
        def body(t, _):
            return (5 * t + 7) % vocab, t

        return jax.lax.scan(body, t0, None, length=half)[1]

    rows = jax.vmap(jax.vmap(run))(starts)  # [batch, 2, half]
    tokens = rows.reshape(batch, seq).astype(jnp.int32)
    seg = jnp.repeat(jnp.array([1, 2], jnp.int32), half)[None].repeat(batch, 0)
    return tokens, seg


REPO = resources.CHECKOUT  # a checkout's root; the data itself is wherever resources.data_root() finds it
STAGES = (
    ("stage1", "pretrain/tiny_stage1.yaml"),
    ("stage2", "pretrain/tiny_stage2.yaml"),
    ("stage3_sft", "pretrain/tiny_stage3_sft.yaml"),
)
RL_STAGE = ("rl", "rl/tiny_disable_debug.yaml")
# stages the demo runs on one device (its mesh all 1s) instead of the config's fake 8-device mesh:
# stage 3's SFT steps take about half the time there on a 2-core CPU (the fake devices' collectives
# and per-device dispatch), with the same losses to float rounding (docs/results/demo_profile.md);
# stages 1 and 2 still show the sharded step (FSDP, experts, context parallelism)
ONE_DEVICE = frozenset({"stage3_sft"})
ONE_DEVICE_MESH = ["mesh.data=1", "mesh.fsdp=1", "mesh.expert=1", "mesh.context=1", "mesh.tensor=1"]
# what the pipeline writes under its output folder (all that a new run clears: nothing else is removed)
OUTPUTS = (*(name for name, _ in STAGES), RL_STAGE[0], "plots", "report.md", "machine.json")


def stage_config(path: str) -> Path:
    """A stage config (e.g. "pretrain/tiny_stage1.yaml") in the bundled configs/."""
    return resources.data_path("configs", *path.split("/"))


def _bundled_source(src, root: Path, echo) -> dict | None:
    """One data source of a stage config with its path (relative to the repository root, as the stage
    configs write it) made absolute in the bundled data; None (with a note) when the bundled data lacks
    it (an installed wheel carries no tests/)."""
    d = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(src).items()}
    d["name"] = src.label  # the label (logs, errors) stays what the config's relative path gave
    path = Path(src.path)
    if path.is_absolute():
        return d
    if path.parts[0] == "src":  # the project's own code: src/ in a checkout, the package when installed
        where = resources.code_root().joinpath(*path.parts[1:])
        if resources.is_packaged():
            d["exclude"] = [*d["exclude"], *resources.CODE_EXCLUDE]
    else:
        where = root / path
    if not where.exists():
        echo(f"(data source {src.label}: {where} is not part of the bundled data; left out)")
        return None
    d["path"] = str(where)
    return d


def bundled_overrides(path: str, echo=print) -> list[str]:
    """Overrides that point a stage config's relative data paths (tokenizer, corpus and SFT sources,
    rl.tasks_dir) at the bundled data, so that the stage runs from any directory."""
    base = cj.load_config(stage_config(path), num_devices=None)
    root = resources.data_root()
    out = []
    if not Path(base.data.tokenizer).is_absolute():
        out.append(f"data.tokenizer={json.dumps(str(root / base.data.tokenizer))}")
    for group in ("sources", "eval_sources"):
        given = getattr(base.data, group)
        if given:
            kept = [d for d in (_bundled_source(s, root, echo) for s in given) if d is not None]
            if not kept:
                raise resources.DataNotFoundError(f"{path}: no data.{group} entry is part of the bundled data")
            out.append(f"data.{group}={json.dumps(kept)}")
    if not Path(base.rl.tasks_dir).is_absolute():
        out.append(f"rl.tasks_dir={json.dumps(str(root / base.rl.tasks_dir))}")
    return out


def async_overrides(cores: int, out_dir: str) -> list[str]:
    """The demo's scheduling on top of the RL config (whatever its family, lr or steps): the
    asynchronous learner (groups sampled up to one policy version ahead of the trainer, weights
    taken in flight), the samplers `composer-jax serve` replicas in processes of their own following
    the run's weight store, the environment servers local processes. With two cores or more, two
    replicas pinned to a core each, the trainer and the environment servers on both: the trainer
    waits on rollouts most of a step, and a core of its own stood idle 75-97% of the time
    (docs/results/demo_profile.md), 32 slots each. The replicas share one compilation cache under
    `out_dir`, so an admission program one compiled the other loads."""
    both = cores >= 2
    return [
        "rl.max_staleness=1",
        f"rl.local_samplers={2 if both else 1}",
        # a step's 64 rollouts across the replicas: a decode step costs in proportion to the slots, busy
        # or not (16.7 ms at 64, 7.4 at 32 here: bench/sampler_programs.py), and most of a step few are busy
        *(["rl.sampler.slots=32"] if both else []),
        f"rl.pin_cores={'true' if both else 'false'}",
        "rl.pin_trainer=false",
        f"rl.sampler.compile_cache={json.dumps(f'{out_dir}/compile_cache')}",
    ]


def rl_stage_config(out_root: str, init_from: str, scale: float, echo=print, extra: Sequence[str] = ()) -> cj.Config:
    """The RL stage's config (configs/rl/tiny_disable_debug.yaml with the bundled data, the
    `async_overrides` and the scaled steps) from the SFT checkpoint `init_from`, writing under
    `out_root`; `extra` overrides go last (bench/demo_profile.py: fewer steps or held-out seeds)."""
    name, path = RL_STAGE
    base = cj.load_config(stage_config(path), num_devices=None)
    own = [
        *bundled_overrides(path, echo),
        f"train.out_dir={json.dumps(f'{out_root}/{name}')}",
        f"train.init_from={json.dumps(init_from)}",
        f"train.steps={max(2, int(base.train.steps * scale))}",
        # 0 (start and end only) stays 0
        f"rl.eval_every={max(1, int(base.rl.eval_every * scale)) if base.rl.eval_every else 0}",
        *async_overrides(len(os.sched_getaffinity(0)), f"{out_root}/{name}"),
    ]
    given = {o.split("=", 1)[0] for o in extra}  # a key `extra` gives replaces the stage's own
    return cj.load_config(stage_config(path), [*(o for o in own if o.split("=", 1)[0] not in given), *extra])


def rl_stage(out_root: str, init_from: str, scale: float, echo=print, extra: Sequence[str] = ()) -> dict:
    """The RL stage from the SFT checkpoint; its summary holds the per-step values and the
    held-out evaluations (rl/evaluate.py: pass@1, best-of-K, reward) before and after, and where
    the time went (runtime/profile.py)."""
    from composer_jax.rl.learner import run_rl

    name = RL_STAGE[0]
    cfg = rl_stage_config(out_root, init_from, scale, echo, extra)
    echo(
        f"\n=== {name}: {', '.join(cfg.rl.tasks)}, {cfg.rl.groups_per_step} groups x {cfg.rl.group_size} rollouts "
        f"per step, {cfg.train.steps} steps, asynchronous (max staleness {cfg.rl.max_staleness}, "
        f"{cfg.rl.local_samplers} sampler replica(s), {cfg.rl.env_servers} environment server(s)); held-out: "
        f"{cfg.rl.eval_seeds} seeds from {cfg.rl.eval_seed} x {cfg.rl.eval_samples} samples ==="
    )
    # one device: the sampler and the small RL step run faster unsharded on a CPU (the config's
    # mesh has fsdp -1, which `composer-jax rl --cpu-devices 1` also resolves to one device)
    summary = run_rl(cfg, mesh=cj.make_mesh(cfg.mesh, jax.devices()[:1]), echo=echo)
    summary["name"], summary["eval_samples"] = name, cfg.rl.eval_samples
    return summary


def stage_devices(name: str, path: str, overrides: list[str]) -> tuple[cj.Config, list]:
    """A pretraining stage's config (the bundled `path` with `overrides`) and the devices it runs on:
    every fake CPU device, or the first alone for the ONE_DEVICE stages (their mesh all 1s)."""
    devices = jax.devices()[:1] if name in ONE_DEVICE else jax.devices()
    extra = ONE_DEVICE_MESH if name in ONE_DEVICE else []
    return cj.load_config(stage_config(path), [*overrides, *extra], num_devices=len(devices)), devices


def pipeline(out_root: str, scale: float, echo=print, rl: bool = True) -> list[dict]:
    """Run the three tiny stages and (rl=True) the RL stage in order; returns one summary per stage."""
    from composer_jax.train.loop import run_stage

    # the stage configs name the corpus, tokenizer and SFT set relative to the repository root:
    # bundled_overrides makes them absolute, so the pipeline runs from any directory
    out_root = str(Path(out_root).resolve())
    results, previous = [], None
    for name, path in STAGES:
        overrides = [*bundled_overrides(path, echo), f"train.out_dir={json.dumps(f'{out_root}/{name}')}"]
        if previous:
            overrides.append(f"train.init_from={json.dumps(str(previous))}")
        base = cj.load_config(stage_config(path), num_devices=None)
        overrides.append(f"train.steps={max(2, int(base.train.steps * scale))}")
        overrides.append(f"train.eval_every={max(1, int(base.train.eval_every * scale))}")
        cfg, devices = stage_devices(name, path, overrides)
        if previous is None:
            mesh = dict(cfg.mesh.shape(len(devices)))
            echo(format_report(build_report(cfg, mesh, cfg.train.batch_size, cfg.train.seq_len)))
        echo(
            f"\n=== {name}: {cfg.data.format} on {cfg.data.sources[0].label}..., seq {cfg.train.seq_len}, "
            f"mesh {cfg.mesh.shape(len(devices))}, {cfg.train.steps} steps ==="
        )
        t0 = time.perf_counter()
        summary = run_stage(cfg, echo=echo, mesh=cj.make_mesh(cfg.mesh, devices))
        summary["name"] = name
        summary["time_s"] = time.perf_counter() - t0
        results.append(summary)
        previous = summary["checkpoint_dir"]
    if rl:
        t0 = time.perf_counter()
        results.append(rl_stage(out_root, str(previous), scale, echo))
        results[-1]["time_s"] = time.perf_counter() - t0
    echo("\nstage        train loss first->last   held-out ppl first->last   MTP-1 acc first->last")
    for r in results[: len(STAGES)]:
        losses = [r["losses"][k] for k in sorted(r["losses"])]
        ev = r["evals"]
        mtp = [e.get("eval/mtp_accuracy/1", float("nan")) for e in (ev[0], ev[-1])]
        echo(
            f"{r['name']:<12} {losses[0]:8.3f} -> {losses[-1]:8.3f}   {ev[0]['eval/perplexity']:10.2f} -> "
            f"{ev[-1]['eval/perplexity']:10.2f}   {mtp[0]:8.3f} -> {mtp[1]:8.3f}   ({r['time_s']:.0f}s)"
        )
        if len(losses) >= 3:
            echo(f"{'':12} train loss {format_trend(trend(sorted(r['losses'].items())))}")
        for source, by_step in (r.get("source_losses") or {}).items():  # a mixture: which source moves it
            points = sorted(by_step.items())
            if len(points) >= 3:
                echo(f"{'':12} nll of {source} ({len(points)} steps) {format_trend(trend(points))}")
    if rl:
        echo(rl_line(results[-1]))
    return results


def rl_line(rl: dict) -> str:
    """The RL stage's summary line: first -> last training step, and the held-out evaluations."""
    steps = [rl["steps"][n] for n in sorted(rl["steps"])]
    first, last = rl["evals"][0], rl["evals"][-1]
    trends = ""
    if len(steps) >= 3:  # a noisy curve's first -> last says little: its slope and quarter means, with errors
        for key, label in (("reward/total", "reward"), ("rollout/success", "success")):
            points = [(n, rl["steps"][n][key]) for n in sorted(rl["steps"])]
            trends += f"{'':13}{label} {format_trend(trend(points))}\n"
    return (
        f"rl           reward {steps[0]['reward/total']:.3f} -> {steps[-1]['reward/total']:.3f}, success "
        f"{steps[0]['rollout/success']:.2f} -> {steps[-1]['rollout/success']:.2f}   ({rl['time_s']:.0f}s)\n"
        + trends
        + f"held-out     pass@1 {first['eval/pass@1']:.3f} (step {first['step']}) -> {last['eval/pass@1']:.3f} "
        f"(step {last['step']}), best-of-{rl['eval_samples']} {first['eval/best_of_k']:.3f} -> "
        f"{last['eval/best_of_k']:.3f}, reward {first['eval/reward']:.3f} -> {last['eval/reward']:.3f}"
        + paired_line(last)
        + time_lines(rl)
    )


def time_lines(rl: dict) -> str:
    """Where the RL stage's time went (runtime/profile.py): the per-step means, and the evaluations' mean
    wall time; '' for a summary without profile values."""
    lines = [time_line([rl["steps"][n] for n in sorted(rl["steps"])])]
    walls = [e["eval/profile/wall_s"] for e in rl["evals"] if "eval/profile/wall_s" in e]
    if walls:
        lines.append(f"{len(walls)} evaluation(s): wall {sum(walls) / len(walls):.3g} s each on average")
    return "".join(f"\n             {x}" for x in lines if x)


def paired_line(ev: dict) -> str:
    """An evaluation's paired change of pass@1 from step 0 (same rollout seeds), when it has one."""
    if "eval/paired_diff" not in ev:
        return ""
    return "\n             paired change " + format_paired(
        {k.removeprefix("eval/paired_"): v for k, v in ev.items() if k.startswith("eval/paired_")}
    )


def prepare_out(out: str | Path) -> Path:
    """The pipeline's output folder, absolute, made if missing; a demo starts fresh (never resumes), so
    what an earlier demo wrote there (OUTPUTS) is removed, and nothing else."""
    import shutil

    root = Path(out).resolve()
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(f"--out {str(out)!r} is not a folder; give a folder for the demo's outputs")
    for name in OUTPUTS:
        p = root / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
    root.mkdir(parents=True, exist_ok=True)
    return root


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="composer-jax demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="a few sharded steps on synthetic data only")
    ap.add_argument(
        "--out",
        default="runs/demo",
        help="output folder of the pipeline (default runs/demo under the current directory); everything the "
        "demo writes goes under it, and a new run clears only what a previous one wrote there",
    )
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every stage's steps by this")
    ap.add_argument(
        "--config", default=None, help="--quick's model config (default: the bundled configs/model/tiny.yaml)"
    )
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. mesh.tensor=2 mesh.fsdp=1")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return _quick(args) if args.quick else _pipeline_main(args)


def _pipeline_main(args: argparse.Namespace) -> int:
    """The whole pipeline (the default): the stages under --out, then the run's report."""
    if args.overrides:
        raise UsageError(
            "key=value overrides apply to --quick only; the pipeline runs the stage configs in "
            "configs/pretrain/tiny_*.yaml"
        )
    if args.scale <= 0:
        raise UsageError(f"--scale {args.scale} must be > 0")
    try:
        out = prepare_out(args.out)
    except OSError as e:
        raise UsageError(str(e)) from e
    os.chdir(out)  # whatever a stage might write relative to the working directory lands under --out too
    from composer_jax import machine

    # the machine beside the wall time (issue 53): a slow run on a slow CPU reads as such
    started, probe = time.perf_counter(), machine.probe()
    print(f"machine: {machine.line(probe)}")
    pipeline(str(out), args.scale)
    wall = time.perf_counter() - started
    (out / "machine.json").write_text(json.dumps({**probe, "wall_s": round(wall, 1)}, indent=1) + "\n")
    print(f"\ndemo wall time {int(wall // 60)}m{int(wall % 60):02d}s on {machine.line(probe)}")
    from composer_jax.report import write_report

    # the run directory's report: loss and perplexity per stage, the RL curves, the evaluations
    print(f"\nreport: {write_report(out, title='composer-jax demo')}")
    return 0


def _quick(args: argparse.Namespace) -> int:
    """--quick: a few sharded steps of the library's step on synthetic data."""
    # the library's step and optimiser: AdamW peaking at 1e-2 after 5 warmup steps, cosine to 0
    train = [
        f"train.steps={args.steps}",
        f"train.batch_size={args.batch}",
        f"train.seq_len={args.seq}",
        "train.optimizer.lr=0.01",
        "train.optimizer.warmup_steps=5",
        "train.optimizer.min_lr_ratio=0.0",
        "train.optimizer.weight_decay=0.01",
        "train.optimizer.clip_norm=0.0",
    ]
    try:
        cfg = cj.load_config(
            args.config or resources.data_path("configs", *CONFIG),
            train + (DEFAULT_OVERRIDES if not args.overrides else args.overrides),
        )
    except cj.ConfigError as e:
        raise UsageError(str(e)) from e
    m = cfg.model
    mesh = cj.make_mesh(cfg.mesh)
    rules = cj.ShardingRules.create(cfg.sharding_rules)
    print(
        f"composer_jax demo: {m.name} on {jax.device_count()} {jax.devices()[0].platform} devices, "
        f"mesh {dict(mesh.shape)}"
    )
    # the model report of `composer-jax inspect`, computed from eval_shape (nothing allocated)
    print(format_report(build_report(cfg, dict(mesh.shape), args.batch, args.seq)))

    state = init_train_state(cfg, mesh, rules)
    step = make_train_step(cfg, mesh, rules)
    placement = batch_sharding(mesh, rules, (args.batch, args.seq))
    key = jax.random.key(1)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        for i in range(args.steps):
            tokens, seg = synthetic_batch(jax.random.fold_in(key, i), args.batch, args.seq, m.vocab_size)
            batch = jax.device_put(
                {
                    "tokens": tokens,
                    "segment_ids": seg,
                    "positions": segment_positions(seg),
                    "loss_mask": jnp.ones(tokens.shape, jnp.float32),
                },
                placement,
            )
            state, metrics = step(state, batch)
            if i % 5 == 0 or i == args.steps - 1:
                counts = metrics["expert_counts"]
                load = counts[-1] / counts[-1].sum()
                print(
                    f"step {i:3d}  loss {float(metrics['loss']):.4f}  next-token nll {float(metrics['nll']):.4f}  "
                    f"grad-norm {float(metrics['grad_norm']):.3f}  last-layer expert load min/max "
                    f"{float(load.min()):.3f}/{float(load.max()):.3f}  ({time.perf_counter() - t0:.1f}s)"
                )
    params = state.params
    print(
        f"embedding sharding: {params['embed'].sharding.spec}; expert weights: "
        f"{params['moe_layers']['moe']['gate'].sharding.spec}"
    )
    print(f"parameters: {count_params(param_specs(m)):,} (incl. MTP); final next-token nll {float(metrics['nll']):.4f}")
    return 0
