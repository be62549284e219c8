"""Asynchronous vs synchronous RL with trainer and sampler in separate processes, each on its own core.

The learner (`composer-jax rl`, src/composer_jax/rl/learner.py) runs once per `rl.max_staleness`
value (default 0, the synchronous learner, then 2), each time as a fresh child process of this
script with the same workload and the same starting weights (the config's seeded initialisation,
which the run saves as its step-0 checkpoint for the replica): the one-choice fixture task
(tests/rl/fixtures/rl_pick.yaml: the tiny MoE, a local environment server), `--steps` steps of
`rl.groups_per_step` x `rl.group_size` rollouts, so the same number of samples. In each run the
trainer's threads are pinned to one core and one `composer-jax serve` replica (the sampler,
`rl.local_samplers=1`) to another (`rl.pin_cores`), as they would be on separate accelerators;
the environment server and its sandboxes share the sampler's core (`--env-cores samplers`, the
default) or run on both (`--env-cores all`: where a core is idle, e.g. the synchronous trainer's
while it waits; on a real deployment they have machines of their own). The optimiser runs at an RL
learning rate (`--lr`, 1e-6) and each version is published as a bf16 copy
(`rl.publish_dtype=bfloat16`) to the run's weight store, which the replica follows.

Compilation: a first, untimed one-step run fills a persistent JAX compilation cache (a temporary
directory) that the timed runs' trainers and replicas then read, so neither pays for compiling.

Printed per run: wall time of the step loop (start-up excluded), the ratio of the
synchronous run's to it, the trainer's idle fraction (time waiting for groups over time waiting
plus training), the staleness distribution of the trained groups (groups per lag in versions, and
the largest per-token lag), groups dropped as stale; and for the weight store: the bytes a follower
reads per version as a share of the full bf16 model (version 1 on: the deltas), and whether the
last version reads back bit-exactly as the bf16 copy of the final checkpoint.

Also printed: the replica's decode steps and mean slot occupancy per run (its /health), the
seconds it spent in decode steps and weight swaps, the trainer's waits for a version load; CPU
seconds per core (trainer; replica + environment server + graders) and the bound they set; a
decode-step sweep by occupied slots on one core and the projection for a device whose decode step
costs the same at any occupancy. `--config`/`--init-from` run another workload, e.g. the demo's RL
stage from its SFT checkpoint (rollouts of 1-6 turns, so lengths vary), `--slots` the replica's
slots in every run (the synchronous one never has more than one step's rollouts in flight).

    PYTHONPATH=src .venv/bin/python bench/async_rl.py [--steps 8] [--staleness 0,2] [--lr 1e-6]
    PYTHONPATH=src .venv/bin/python bench/async_rl.py --config configs/rl/tiny_disable_debug.yaml \
        --init-from runs/demo/stage3_sft/checkpoints --group-size 8 --slots 32 --steps 4 --staleness 0,1

Needs two cores (three or more leave the environment server a core of its own) and bubblewrap.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "tests" / "rl" / "fixtures" / "rl_pick.yaml"


def overrides(out: Path, args: argparse.Namespace, staleness: int) -> list[str]:
    extra = [f"train.init_from={Path(args.init_from).resolve()}"] if args.init_from else []
    if args.slots:
        extra.append(f"rl.sampler.slots={args.slots}")
    return [
        *extra,
        "mesh.fsdp=1",
        "mesh.data=1",
        "mesh.expert=1",
        "mesh.context=1",
        "mesh.tensor=1",
        f"train.out_dir={out}",
        f"train.steps={args.steps}",
        f"train.optimizer.lr={args.lr}",
        "checkpoint.save_every=1000",
        "rl.eval_tasks=[]",
        f"rl.group_size={args.group_size}",
        f"rl.groups_per_step={args.groups_per_step}",
        f"rl.max_staleness={staleness}",
        f"rl.staleness_unit={args.unit}",
        "rl.local_samplers=1",
        "rl.pin_cores=true",
        f"rl.env_cores={args.env_cores}",
        "rl.publish_dtype=bfloat16",
        "rl.sampler.poll_s=5.0",  # the trainer tells the replica each version; polling is the fallback
        *args.overrides,
    ]


def core_busy_s() -> dict[int, float]:
    """Seconds each CPU core has been busy (user, nice, system, irq, softirq) since boot, every
    process on it counted (/proc/stat; {} where it is not readable)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for line in lines:
        name, *f = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            user, nice, system, _idle, _iowait, irq, softirq = map(int, f[:7])
            out[int(name[3:])] = (user + nice + system + irq + softirq) / tick
    return out


def child(args: argparse.Namespace) -> None:
    """One learner run (this process is the trainer); its summary as JSON on the last line."""
    from composer_jax.config import load_config
    from composer_jax.rl.learner import run_rl

    os.chdir(REPO)
    out = Path(args.out)
    cfg = load_config(args.config, overrides(out, args, args.child))
    cores = sorted(os.sched_getaffinity(0))  # run_rl pins the trainer to the first, the replica to the next
    t0 = time.perf_counter()
    busy0 = core_busy_s()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    s = run_rl(cfg, echo=lambda m: print(m, file=sys.stderr))
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    busy1 = core_busy_s()
    # the replica, the environment server and its graders: children reaped by the end of run_rl
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    steps = s["steps"].values()
    lags: dict[int, int] = {}
    for v in steps:
        for k, n in v.items():
            if k.startswith("staleness/groups_") and n:
                d = int(k.rsplit("_", 1)[1])
                lags[d] = lags.get(d, 0) + int(n)
    res = {
        "staleness": args.child,
        "wall_s": s["wall_s"],
        "total_s": time.perf_counter() - t0,
        "idle": s["trainer_idle_fraction"],
        "lags": lags,
        "token_lag_max": max(v.get("version_lag_max", 0.0) for v in steps),
        "dropped": len(s["dropped_stale_groups"]),
        "trained_groups": sum(len(x) for x in s["trained_groups"].values()),
        "checkpoint_dir": s["checkpoint_dir"],
        "samplers": s.get("samplers", []),
        "cpu_trainer": cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime,
        "cpu_sampler_side": kids.ru_utime + kids.ru_stime,
        # every process's seconds on the replica's core, the sandboxes' tool and test runs included
        # (reparented when their sandbox exits, so RUSAGE_CHILDREN above misses them)
        "sampler_core_busy_s": busy1[cores[1]] - busy0[cores[1]] if len(cores) > 1 and busy0 and busy1 else None,
        "trainer_core_busy_s": busy1[cores[0]] - busy0[cores[0]] if busy0 and busy1 else None,
        "load_wait_s": sum(v.get("time/load_wait_s", 0.0) for v in steps),
        "slots": cfg.rl.sampler.slots,
        "rollouts_per_step": cfg.rl.groups_per_step * cfg.rl.group_size,
        "tokens": sum(v["rollout/generated_tokens"] * v["rollout/groups"] * cfg.rl.group_size for v in steps),
    }
    n = sum(v["rollout/groups"] for v in steps)  # each step's means weigh by its groups (of equal size)
    for key in ("update_s", "publish_s", "wait_s"):  # the trainer's seconds per step: update, publish, waiting
        res["trainer_" + key] = sum(v.get("time/" + key, 0.0) for v in steps) / max(len(steps), 1)
    for key in ("policy_s", "env_s", "wall_s"):
        res["rollout_" + key] = sum(v.get("rollout/" + key, 0.0) * v["rollout/groups"] for v in steps) / max(n, 1)
    print(json.dumps(res))


def decode_sweep(args: argparse.Namespace) -> None:
    """Decode-step time against the number of occupied slots, the replica's way (the run's model and
    weights, rl.sampler.slots slots of train.seq_len, one core): a step decoding n requests costs
    about the same as one decoding 1 when the device is bound by reading the weights (an
    accelerator); where it grows with n, fuller slots raise no throughput. JSON on the last line."""
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    import jax

    from composer_jax.checkpoint.manager import restore_params_only
    from composer_jax.config import load_config
    from composer_jax.inference.engine.batch_sampler import Request, Sampler, SamplerSettings
    from composer_jax.inference.engine.token_sampling import SamplingParams
    from composer_jax.model.params import abstract_params, init_params
    from composer_jax.sharding import ShardingRules, make_mesh

    os.chdir(REPO)
    cfg = load_config(args.config, overrides(Path(args.out), args, 0))
    mesh, rules = make_mesh(cfg.mesh), ShardingRules.create(cfg.sharding_rules)
    if cfg.train.init_from:
        params = restore_params_only(cfg.train.init_from, abstract_params(cfg.model, mesh, rules))
    else:
        params = init_params(cfg.model, jax.random.key(cfg.train.seed), mesh, rules)
    slots, n_steps, out = cfg.rl.sampler.slots, 24, {}
    sampler = Sampler(
        params, cfg.model, SamplerSettings(slots=slots, max_len=cfg.train.seq_len, mesh=mesh, rules=rules)
    )
    prompt = list(range(10, 74))
    for n in sorted({1, max(1, slots // 4), max(1, slots // 2), slots}):
        for i in range(n):
            sampler.submit(Request(prompt, SamplingParams(max_tokens=3 * n_steps, seed=i), id=f"{n}-{i}"))
        for _ in range(4):  # admission (prefill) and warm-up
            sampler.step()
        t0 = time.perf_counter()
        for _ in range(n_steps):
            sampler.step()
        out[n] = (time.perf_counter() - t0) / n_steps
        for i in range(n):
            sampler.cancel(f"{n}-{i}")
    print(json.dumps({"slots": slots, "step_s": out}))


def store_figures(config: str, out: Path, cfg_overrides: list[str], steps: int) -> tuple[list[float], bool]:
    """(follower bytes per version 1..steps as a share of the full bf16 model, last version bit-exact)."""
    import jax
    import numpy as np

    from composer_jax.checkpoint.manager import restore_params_only
    from composer_jax.config import load_config
    from composer_jax.model.params import abstract_params
    from composer_jax.sharding import ShardingRules, make_mesh
    from composer_jax.train.loop import run_checkpoint_config
    from composer_jax.weightsync.subscriber import WeightSubscriber

    sub = WeightSubscriber(f"file://{out}/weight_store")
    _, first = sub.read(0)
    raw = sum(np.asarray(x).nbytes for x in jax.tree.leaves(first))
    shares = []
    for v in range(1, steps + 1):
        before = sub.bytes_read
        got, last = sub.read(v)
        assert got == v, (got, v)
        shares.append((sub.bytes_read - before) / raw)
    cfg = load_config(config, cfg_overrides)
    mesh = make_mesh(cfg.mesh)
    abstract = abstract_params(cfg.model, mesh, ShardingRules.create(cfg.sharding_rules))
    params = jax.device_get(restore_params_only(run_checkpoint_config(cfg).directory, abstract, steps))
    exact = all(
        np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).astype(a.dtype).view(np.uint8))
        for a, b in zip(jax.tree.leaves(last), jax.tree.leaves(params), strict=True)
    )
    return shares, exact


def main() -> None:
    from composer_jax.config.rl import ENV_CORES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--staleness", default="0,2", help="comma-separated rl.max_staleness values (the first: baseline)")
    ap.add_argument("--unit", default="token", choices=["token", "group"])
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--groups-per-step", type=int, default=2)
    ap.add_argument("--config", default=str(CONFIG), help="the RL config (default: the one-choice fixture task)")
    ap.add_argument("--init-from", default="", help="a checkpoint every run starts from (default: the seeded init)")
    ap.add_argument("--slots", type=int, default=0, help="rl.sampler.slots of every run (default: the config's)")
    ap.add_argument(
        "--env-cores",
        default="samplers",
        choices=ENV_CORES,
        help="rl.env_cores: the environment servers and their sandboxes on the sampler's core or on both",
    )
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="config KEY=VALUE overrides for every run")
    args = ap.parse_args()
    if args.child is not None:
        decode_sweep(args) if args.child < 0 else child(args)
        return
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("bench/async_rl.py needs at least two cores (one for the trainer, one for the sampler)")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH", "")]))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        env.update(JAX_COMPILATION_CACHE_DIR=f"{tmp}/jax-cache", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

        def run(s: int, out: Path, steps: int) -> dict:
            cmd = [sys.executable, __file__, "--child", str(s), "--out", str(out), "--steps", str(steps)]
            cmd += ["--unit", args.unit, "--lr", str(args.lr), "--group-size", str(args.group_size)]
            cmd += ["--groups-per-step", str(args.groups_per_step), "--config", args.config]
            cmd += ["--init-from", args.init_from, "--slots", str(args.slots), "--env-cores", args.env_cores]
            cmd += args.overrides
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
            if proc.returncode != 0:
                sys.exit(f"run with max_staleness={s} failed:\n{proc.stderr[-4000:]}")
            return json.loads(proc.stdout.strip().splitlines()[-1])

        sweep = run(-1, Path(tmp) / "sweep", 1)
        run(0, Path(tmp) / "warm-up", 1)
        for s in [int(x) for x in args.staleness.split(",")]:
            out = Path(tmp) / f"s{s}"
            res = run(s, out, args.steps)
            os.environ["XLA_FLAGS"] = env["XLA_FLAGS"]
            res["store"] = store_figures(args.config, out, overrides(out, args, s), args.steps)
            rows.append(res)
    base = rows[0]["wall_s"]
    samples = args.steps * args.groups_per_step * args.group_size
    print(
        f"workload: {args.steps} steps x {args.groups_per_step} groups x {args.group_size} rollouts = {samples} "
        f"samples ({Path(args.config).name}{', from ' + args.init_from if args.init_from else ''}), lr {args.lr:g}, "
        f"trainer and 1 sampler replica ({rows[0]['slots']} slots) pinned to a core each; environment servers "
        f"and sandboxes on {'the sampler core' if args.env_cores == 'samplers' else 'both cores'}"
    )
    print(
        f"{'staleness':>9} {'wall s':>8} {'ratio':>6} {'idle':>6} {'trained':>7} {'dropped':>7} "
        f"{'max token lag':>13}  groups per lag"
    )
    for r in rows:
        print(
            f"{r['staleness']:9d} {r['wall_s']:8.2f} {base / r['wall_s']:6.2f} {r['idle']:6.2f} "
            f"{r['trained_groups']:7d} {r['dropped']:7d} {r['token_lag_max']:13.0f}  {r['lags']}"
        )
    print(
        f"{'staleness':>9} {'slots':>5} {'decode steps':>12} {'occupancy':>9} {'decode s':>8} {'swap s':>6} "
        f"{'load wait s':>11} {'tokens':>7}  (the replica's decode steps; occupancy: mean share of slots decoding)"
    )
    for r in rows:
        for h in r["samplers"]:
            occ = h["slot_steps"] / max(h["steps"] * h["slots"], 1)
            print(
                f"{r['staleness']:9d} {h['slots']:5d} {h['steps']:12d} {occ:9.2f} {h['step_s']:8.1f} "
                f"{h['swap_s']:6.2f} {r['load_wait_s']:11.2f} {r['tokens']:7.0f}"
            )
    print(
        f"{'staleness':>9} {'prefix cache':>12} {'admitted':>8} {'hits':>6} {'reused':>8} {'prefilled':>9} "
        f"{'hit rate':>8} {'prefill s':>9} {'compilations':>12}  (the replica's prompt tokens: reused from cached "
        "prefixes or prefilled; seconds admitting requests, part of decode s; programs traced)"
    )
    for r in rows:
        for h in r["samplers"]:
            p = h.get("prefix", {})
            print(
                f"{r['staleness']:9d} {h.get('prefix_cache', '?'):>12} {p.get('admitted', 0):8d} "
                f"{p.get('hits', 0):6d} {p.get('reused', 0):8d} {p.get('prefilled', 0):9d} "
                f"{p.get('hit_rate', 0.0):8.2f} {h.get('prefill_s', 0.0):9.1f} {h.get('compilations', 0):12d}"
            )
    print(
        f"{'staleness':>9} {'rollout s':>9} {'sampler s':>9} {'env s':>7} {'other s':>7}  (a trained rollout's mean "
        "seconds: in all; awaiting its turns from the replica (HTTP, queue, prefill, decode); the environment server "
        "(session, tool runs, grading); the rest (the client's own work and waits for the event loop))"
    )
    for r in rows:
        w, p, e = r["rollout_wall_s"], r["rollout_policy_s"], r["rollout_env_s"]
        print(f"{r['staleness']:9d} {w:9.2f} {p:9.2f} {e:7.2f} {w - p - e:7.2f}")
    print(
        f"{'staleness':>9} {'update s':>8} {'publish s':>9} {'wait s':>6}  (the trainer's mean seconds per step: the "
        "batch and the optimiser update; writing the new version to the weight store; waiting for groups)"
    )
    for r in rows:
        print(
            f"{r['staleness']:9d} {r['trainer_update_s']:8.2f} {r['trainer_publish_s']:9.2f} {r['trainer_wait_s']:6.2f}"
        )
    print(
        "CPU seconds per core (start-up included): trainer core / sampler core (replica, environment server, "
        "graders); a run's wall time cannot go below the busier core's"
    )
    for r in rows:
        busier = max(r["cpu_trainer"], r["cpu_sampler_side"])
        print(
            f"{r['staleness']:9d} trainer {r['cpu_trainer']:7.1f}  sampler side {r['cpu_sampler_side']:7.1f}  "
            f"wall {r['total_s']:7.1f}  -> wall / busier core {r['total_s'] / busier:.2f}"
        )
    for r in rows:
        replica = sum(h.get("process_cpu_s", 0.0) for h in r["samplers"])
        print(
            f"{r['staleness']:9d} of the sampler side: replica {replica:7.1f}, environment server and graders "
            f"{r['cpu_sampler_side'] - replica:7.1f} (the replica's own /health figure, taken at the end of the run)"
        )
        if r.get("sampler_core_busy_s") is not None:
            other = r["sampler_core_busy_s"] - r["cpu_sampler_side"]
            print(
                f"{r['staleness']:9d} the sampler core was busy {r['sampler_core_busy_s']:7.1f} s of the run's "
                f"{r['total_s']:.1f} (/proc/stat, every process): {other:7.1f} "
                "s by processes not counted above (the sandboxes' tool and test runs, reparented when their sandbox "
                "exits, and the kernel's work for them)"
            )
        if r.get("trainer_core_busy_s") is not None:
            print(
                f"{r['staleness']:9d} the trainer core was busy {r['trainer_core_busy_s']:7.1f} s (/proc/stat, every "
                f"process), the trainer {r['cpu_trainer']:7.1f}"
            )
    if len(rows) > 1 and args.env_cores == "all":
        print("CPU-seconds bound: not computed (the environments' seconds fall on both cores)")
    elif len(rows) > 1:

        def side(r: dict) -> float:  # its core's /proc/stat seconds where read (the uncounted sandboxes included)
            return r.get("sampler_core_busy_s") or r["cpu_sampler_side"]

        serial = rows[0]["cpu_trainer"] + side(rows[0])
        best = min(max(r["cpu_trainer"], side(r)) for r in rows[1:])
        print(
            f"CPU-seconds bound: the synchronous loop alternates (training, then sampling: >= {serial:.1f} core-s at "
            f"full speed), the asynchronous one overlaps (>= its busier core, {best:.1f}): a ratio of at most "
            f"{serial / best:.2f}x on two idle cores (start-up included on both sides; the sampler side is its "
            "core's busy seconds where /proc/stat was read)"
        )
    f = rows[0]["idle"]
    one, full = sweep["step_s"]["1"], sweep["step_s"][str(sweep["slots"])]
    print(
        f"decode step on one core, {sweep['slots']} slots (ms per step by occupied slots): "
        + ", ".join(f"{n}: {1e3 * t:.1f}" for n, t in sweep["step_s"].items())
        + f"; per occupied slot, 1 vs all: {1e3 * one:.1f} vs {1e3 * full / sweep['slots']:.1f}"
    )
    occ = [
        sum(h["slot_steps"] for h in r["samplers"]) / max(sum(h["steps"] * h["slots"] for h in r["samplers"]), 1)
        for r in rows
    ]
    if len(rows) > 1 and occ[0] > 0:
        gain = max(o for o in occ[1:]) / occ[0]
        print(
            f"on a device whose decode step costs the same at any occupancy, the asynchronous run's occupancy "
            f"({max(occ[1:]):.2f} vs {occ[0]:.2f}) would sample {gain:.2f}x faster: a bound of "
            f"1/max({f:.2f}/{gain:.2f}, {1 - f:.2f}) = {1 / max(f / gain, 1 - f):.2f}x (a projection, not measured)"
        )
    print(
        f"overlap bound: the synchronous trainer waited {f:.0%} of its loop for groups, so sampling S and training T "
        f"stand about {f:.2f}:{1 - f:.2f}; a perfect overlap takes max(S, T), a ratio of at most "
        f"1/max({f:.2f}, {1 - f:.2f}) = {1 / max(f, 1 - f):.2f}x"
    )
    for r in rows:
        shares, exact = r["store"]
        mean = sum(shares) / len(shares)
        print(
            f"weight store (max_staleness={r['staleness']}): a follower reads per version {mean:.2%} of the full "
            f"bf16 model (min {min(shares):.2%}, max {max(shares):.2%}); last version bit-exact: {exact}"
        )


if __name__ == "__main__":
    main()
