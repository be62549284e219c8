"""What the `ray` placement costs over the `local` one (issue 51, item 7), measured in one run.

Runs the same RL command under `--placement local` and `--placement ray` (a local Ray cluster
started by the run, as on a laptop), alternating, `--repeats` times each, and prints per placement:
the wall time of the whole command, the time to the first step's start (step 1's record in
metrics.jsonl less its `time/step_s`, from the command's start: imports, the checkpoint, placing
the fleet and waiting for it to be up), and the
median `time/step_s` of the steps after the first (the first compiles). The default fleet: one
environment server and one `serve` replica (`rl.local_samplers=1`) on the RL CLI test's fixture
(tests/rl/fixtures/rl_pick.yaml: the tiny MoE, random init); `--config` and overrides take another
(configs/rl/tiny_disable_debug.yaml is the demo's, after `composer-jax demo` wrote its checkpoint).

    PYTHONPATH=src .venv/bin/python bench/placement.py [--steps 4] [--repeats 2] [--config C] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from composer_jax import machine

REPO = Path(__file__).resolve().parents[1]
FIXTURE = "tests/rl/fixtures/rl_pick.yaml"


def one_run(config: str, placement: str, steps: int, overrides: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "composer_jax.cli", "rl", "--config", config, "--placement", placement]
    cmd += [f"train.steps={steps}", "rl.eval_tasks=[]", f"train.out_dir={out}", *overrides]
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start_wall = time.time()
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"{placement}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r.get("step") == 1)
    step_times = [r["time/step_s"] for r in rows if r.get("step", 0) >= 2 and "time/step_s" in r]
    return {
        "wall_s": wall,
        # when step 1 began: its record's time less its own length
        "to_first_step_s": first["time"] - first["time/step_s"] - start_wall,
        "step_s": statistics.median(step_times) if step_times else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=FIXTURE)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("overrides", nargs="*", default=[])
    args = ap.parse_args()
    overrides = args.overrides or ["rl.local_samplers=1", "rl.sampler.slots=8"]
    results: dict[str, list[dict]] = {"local": [], "ray": []}
    with tempfile.TemporaryDirectory(prefix="bench-placement-") as tmp:
        for r in range(args.repeats):
            for placement in ("local", "ray"):
                results[placement].append(
                    one_run(args.config, placement, args.steps, overrides, Path(tmp) / f"{placement}-{r}")
                )
    print(f"# bench/placement.py: {args.config} {' '.join(overrides)}, {args.steps} steps, {args.repeats} runs each")
    print(f"# CPU: {machine.cpu_model()} ({os.cpu_count()} logical cores)")
    print("| placement | wall (median) | to the first step (median) | step after the first (median) |")
    print("| --- | --- | --- | --- |")
    med = {}
    for placement, runs in results.items():
        med[placement] = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        m = med[placement]
        print(f"| {placement} | {m['wall_s']:.1f} s | {m['to_first_step_s']:.1f} s | {m['step_s']:.2f} s |")
    extra = med["ray"]["to_first_step_s"] - med["local"]["to_first_step_s"]
    ratio = med["ray"]["step_s"] / med["local"]["step_s"]
    print(f"ray - local, to the first step: {extra:+.1f} s (target <= 30 s); step time ratio ray/local: {ratio:.3f}")


if __name__ == "__main__":
    main()
