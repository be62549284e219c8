"""Where the demo's RL stage spends its time: a short run of it, then the "Where the time goes" table.

Runs the RL stage exactly as `composer-jax demo` does (`demo.rl_stage_config`: configs/rl/tiny_disable_debug.yaml,
the asynchronous learner, one `composer-jax serve` replica and the local environment servers, cores
pinned on 2+ cores, one device) from the demo's stage-3 (SFT) checkpoint, for `--steps` steps and a
held-out evaluation of `--eval-seeds` seeds (x the config's 2 samples) at the start and the end;
then prints the learner's profile (src/composer_jax/runtime/profile.py): per step and per evaluation the
wall time, the trainer's wait and update, the replica's prefill, decode, tokenising and HTTP
seconds, the environment servers' tool-call and grading seconds, and each core's busy share; and
writes the run's report (`composer-jax report`) with the same table under --out.

The stage-3 checkpoint is what `make demo` (or `composer-jax demo`) leaves under its output folder:
`runs/demo/stage3_sft/checkpoints` by default (--init-from). Without one, `--tiny` checks the
profile on the one-choice fixture task (tests/rl/fixtures/rl_pick.yaml: the tiny MoE from a
random initialisation, one local replica): its figures are not the demo's.

    PYTHONPATH=src .venv/bin/python bench/demo_profile.py --init-from runs/demo/stage3_sft/checkpoints \
        [--steps 3] [--eval-seeds 64] [--out runs/demo_profile] [key=value ...]
    PYTHONPATH=src .venv/bin/python bench/demo_profile.py --tiny [--steps 2]

Needs bubblewrap (the environment servers' sandbox); two cores or more to pin as the demo does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from composer_jax import demo  # (first: it asks JAX for the demo's CPU devices before JAX starts)
from composer_jax.errors import UsageError
from composer_jax.report import where_the_time_goes, write_report

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "tests" / "rl" / "fixtures" / "rl_pick.yaml"


def _config(args: argparse.Namespace, out: Path):
    import composer_jax as cj

    if args.tiny:
        cores = len(os.sched_getaffinity(0))
        overrides = [
            f"train.out_dir={json.dumps(str(out / 'rl'))}",
            f"train.steps={args.steps}",
            "mesh.fsdp=-1",  # one device, as the demo's RL stage
            "rl.local_samplers=1",
            f"rl.pin_cores={'true' if cores >= 2 else 'false'}",
            f"rl.tasks_dir={json.dumps(str(REPO / 'tests' / 'rl' / 'fixtures' / 'tasks'))}",
            f"data.tokenizer={json.dumps(str(REPO / 'assets' / 'tokenizer'))}",
            *([f"rl.eval_seeds={args.eval_seeds}"] if args.eval_seeds is not None else []),
            *args.overrides,
        ]
        return cj.load_config(TINY, overrides)
    init = Path(args.init_from)
    if not (init.is_dir() and any(init.iterdir())):
        raise UsageError(
            f"--init-from {str(init)!r} holds no checkpoint: give the demo's stage-3 checkpoints (what `make demo` "
            "writes under runs/demo/stage3_sft/checkpoints), or --tiny to check the profile on the fixture task"
        )
    extra = [f"train.steps={args.steps}", *([f"rl.eval_seeds={args.eval_seeds}"] if args.eval_seeds else [])]
    return demo.rl_stage_config(str(out), str(init.resolve()), 1.0, print, [*extra, *args.overrides])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--init-from", default="runs/demo/stage3_sft/checkpoints", help="the demo's SFT checkpoints")
    ap.add_argument("--tiny", action="store_true", help="the fixture task from a random model instead")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--eval-seeds", type=int, default=None, help="held-out seeds (default: the config's)")
    ap.add_argument("--out", default="runs/demo_profile", help="the run's folder (its rl/ is replaced)")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides, last")
    args = ap.parse_args(argv)
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: give at least 1")
    out = Path(args.out).resolve()
    if (out / "rl").exists():
        import shutil

        shutil.rmtree(out / "rl")  # a fresh run, not a resume of the last one
    out.mkdir(parents=True, exist_ok=True)
    cfg = _config(args, out)

    import jax

    import composer_jax as cj
    from composer_jax.rl.learner import run_rl

    t0 = time.perf_counter()
    # one device, as the demo's RL stage: the sampler and the small RL step run faster unsharded on a CPU
    summary = run_rl(cfg, mesh=cj.make_mesh(cfg.mesh, jax.devices()[:1]), echo=print)
    wall = time.perf_counter() - t0
    print(f"\nRL stage: {cfg.train.steps} step(s) in {wall:.0f} s ({'fixture task' if args.tiny else 'demo RL stage'})")
    print(demo.time_lines({**summary, "steps": summary["steps"], "evals": summary["evals"]}).strip())
    print()
    print(where_the_time_goes(Path(cfg.train.out_dir) / "metrics.jsonl"))
    print(f"\nreport: {write_report(out, title='demo RL stage profile')}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
