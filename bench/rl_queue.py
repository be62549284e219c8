"""The rollout queue (src/composer_jax/rl/rollout/queue.py): synchronous vs asynchronous learner, one process.

Runs the RL learner on the one-choice fixture task (tests/rl/fixtures/rl_pick.yaml: the tiny MoE,
random init, a local environment server) for the same number of steps (so the same number of
trained groups) from the same initial weights, once per `rl.max_staleness` value, and prints per
run: wall time of the step loop, its ratio to the first run's, the trainer's idle fraction (time
waiting for groups over time waiting plus training), the staleness of the trained groups (groups
per lag, in `rl.staleness_unit`), the largest per-token version lag and the groups dropped as stale.

Here trainer, sampler and environment share one process and the machine's cores, so the overlap the
queue buys is bounded by what the cores can run at once; on separate accelerators it is larger.

    PYTHONPATH=src .venv/bin/python bench/rl_queue.py [--steps 8] [--staleness 0,2] [--unit token]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--staleness", default="0,2", help="comma-separated rl.max_staleness values")
    ap.add_argument("--unit", default="token", choices=["token", "group"])
    ap.add_argument("overrides", nargs="*", help="config KEY=VALUE overrides for every run")
    args = ap.parse_args()

    from composer_jax.config import load_config
    from composer_jax.rl.learner import run_rl

    os.chdir(REPO)
    rows = []
    for s in [int(x) for x in args.staleness.split(",")]:
        with tempfile.TemporaryDirectory() as out:
            overrides = [
                "mesh.fsdp=1",
                f"train.out_dir={out}",
                f"train.steps={args.steps}",
                "rl.eval_tasks=[]",
                "checkpoint.save_every=1000",
                f"rl.max_staleness={s}",
                f"rl.staleness_unit={args.unit}",
                *args.overrides,
            ]
            cfg = load_config("tests/rl/fixtures/rl_pick.yaml", overrides)
            summary = run_rl(cfg, echo=lambda _: None)
        steps = summary["steps"].values()
        lags = {d: int(sum(v.get(f"staleness/groups_{d}", 0) for v in steps)) for d in range(s + 1)}
        rows.append(
            (
                s,
                summary["wall_s"],
                summary["trainer_idle_fraction"],
                lags,
                max(v.get("version_lag_max", 0) for v in steps),
                len(summary["dropped_stale_groups"]),
                sum(len(g) for g in summary["trained_groups"].values()),
            )
        )
    base = rows[0][1]
    print(f"{args.steps} steps, staleness unit {args.unit}; one process on {os.cpu_count()} CPU core(s)")
    print("max_staleness  wall_s  ratio_to_first  trainer_idle  groups_per_lag  max_token_lag  dropped  trained")
    for s, wall, idle, lags, lag_max, dropped, trained in rows:
        print(
            f"{s:13d}  {wall:6.1f}  {base / wall:14.2f}  {idle:12.2f}  {str(lags):>14}  {lag_max:13.0f}  "
            f"{dropped:7d}  {trained:7d}"
        )


if __name__ == "__main__":
    main()
