"""`composer-jax pretrain|sft --config FILE [key=value ...]`: run one training stage.

Multi-host: the same command on every host. With --coordinator/--num-processes/--process-id (or
the JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID environment variables, or a
cluster JAX detects by itself such as SLURM), `jax.distributed.initialize` joins the processes
before anything else touches JAX; each process then feeds its own slice of the batch.

With --placement ray (train.placement: ray), this command starts no training itself: Ray places
train.ray.hosts trainer processes, one per node, each this same command joined to the others
(runtime/ray_trainer.py; docs/cluster.md), and this one prints the first host's output.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

from composer_jax.errors import UsageError, UserError


def _parser(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="stage YAML, e.g. configs/pretrain/tiny_stage1.yaml")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=10 mesh.fsdp=2")
    ap.add_argument("--stop-after", type=int, default=None, help="stop after N steps of this run (crash test)")
    add_placement_args(ap)
    add_jax_args(ap)
    return ap


def add_placement_args(ap: argparse.ArgumentParser, fleet: str = "") -> None:
    """--placement and --hosts: where the trainer runs (train.placement, train.ray.hosts)."""
    ap.add_argument(
        "--placement",
        choices=("local", "ray"),
        help="local: train in this process (with --coordinator, one of several started by hand); ray: one trainer "
        f"actor per host placed by Ray{fleet} (train.ray; docs/cluster.md); sets train.placement",
    )
    ap.add_argument("--hosts", type=int, default=None, help="with --placement ray: trainer hosts (train.ray.hosts)")


def placement_overrides(args: argparse.Namespace, rl: bool = False) -> list[str]:
    """The config overrides --placement and --hosts stand for."""
    out = []
    if args.placement:
        out.append(f"train.placement={args.placement}")
        if rl:
            out.append(f"rl.placement={args.placement}")
    if args.hosts is not None:
        out.append(f"train.ray.hosts={args.hosts}")
    return out


def place_trainer(subcommand: str, args: argparse.Namespace, fleet: Callable[[Any], list] | None = None) -> int | None:
    """With train.placement ray: the run's exit status once Ray's trainer hosts have ended
    (runtime/ray_trainer.py); None when the trainer runs in this process (JAX not started yet)."""
    from composer_jax.config import load_config

    rl = subcommand == "rl"
    overrides = [*args.overrides, *placement_overrides(args, rl)]
    try:
        cfg = load_config(args.config, overrides, num_devices=None)  # the hosts check the mesh
    except UserError as e:
        raise UsageError(str(e)) from e
    if cfg.train.placement != "ray":
        if args.hosts is not None:
            raise UsageError(f"--hosts {args.hosts} needs --placement ray (or train.placement: ray)")
        return None
    if args.coordinator or args.distributed:
        raise UsageError(
            "--placement ray starts the trainer's processes and joins them itself: drop --coordinator / --distributed"
        )
    flags = [] if args.stop_after is None else ["--stop-after", str(args.stop_after)]
    flags += [] if args.cpu_devices is None else ["--cpu-devices", str(args.cpu_devices)]
    # each host trains where it is: its own `train.placement=local` (host_argv, after the overrides:
    # positional arguments stay together) replaces the run's
    kept = [o for o in overrides if not o.startswith("train.placement=")]
    argv = [subcommand, *flags, "--config", args.config, *kept]
    from composer_jax.runtime.placement import LaunchError
    from composer_jax.runtime.ray_trainer import run_trainer

    try:
        return run_trainer(cfg.train.ray, argv, fleet=fleet(cfg) if fleet else ())
    except LaunchError as e:
        raise UsageError(str(e)) from e


def add_jax_args(ap: argparse.ArgumentParser) -> None:
    """The flags `init_jax` reads: multi-host (`jax.distributed`) and the fake CPU device count."""
    ap.add_argument("--coordinator", default=os.environ.get("JAX_COORDINATOR_ADDRESS"))
    ap.add_argument("--num-processes", type=int, default=int(os.environ.get("JAX_NUM_PROCESSES", "0")) or None)
    ap.add_argument("--process-id", type=int, default=int(os.environ.get("JAX_PROCESS_ID", "-1")))
    ap.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        help="CPU only: devices per process (a fake mesh on one machine; default 8 without --coordinator, else 1)",
    )
    ap.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() with cluster auto-detection (SLURM, TPU, ...)",
    )


def init_jax(args) -> None:
    """Start JAX for a training job: multi-host when asked, else a fake CPU mesh on a CPU-only machine."""
    # XLA's C++ INFO/WARNING lines (SPMD resharding notes) drown the progress bar; errors still show.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import jax

    cpu_only = not any(d for d in ("cuda", "rocm", "tpu") if os.environ.get("JAX_PLATFORMS", "").find(d) >= 0)
    if args.coordinator:
        if args.num_processes is None or args.process_id < 0:
            raise UsageError(
                "--coordinator needs --num-processes and --process-id (or JAX_NUM_PROCESSES / JAX_PROCESS_ID)"
            )
        if cpu_only:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.config.update("jax_num_cpu_devices", args.cpu_devices or 1)
        jax.distributed.initialize(
            coordinator_address=args.coordinator, num_processes=args.num_processes, process_id=args.process_id
        )
    elif args.distributed:
        jax.distributed.initialize()
    elif cpu_only:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices or 8)


def _main(argv: list[str] | None, prog: str, fmt: str) -> int:
    args = _parser(prog).parse_args(argv)
    if (status := place_trainer(prog.split()[-1], args)) is not None:
        return status
    init_jax(args)
    from composer_jax.config import ConfigError, load_config
    from composer_jax.train.loop import run_stage

    try:
        cfg = load_config(args.config, args.overrides)
        if cfg.data.format != fmt:
            raise ConfigError(
                f"{prog} needs data.format={fmt!r}, the config has {cfg.data.format!r}; "
                f"use `composer-jax {'sft' if fmt == 'pretrain' else 'pretrain'}` for it"
            )
        if not cfg.data.sources:
            raise ConfigError("data.sources is empty; a training stage needs at least one source")
        summary = run_stage(cfg, stop_after=args.stop_after)
    # the user's faults only (errors.py `UserError`: a config value, a checkpoint or file the config
    # names); any other exception, a ValueError or a FileNotFoundError too, is a bug and keeps its
    # traceback
    except UserError as e:
        raise UsageError(str(e)) from e
    final = summary["evals"][-1] if summary["evals"] else {}
    print(
        json.dumps(
            {
                "stage": cfg.train.stage,
                "steps": summary.get("stopped_at", summary["final_step"]),
                "final_loss": summary["losses"].get(max(summary["losses"] or [0]), None),
                "eval": final,
            },
            default=float,
        )
    )
    return 0


def pretrain_main(argv: list[str] | None = None) -> int:
    return _main(argv, "composer-jax pretrain", "pretrain")


def sft_main(argv: list[str] | None = None) -> int:
    return _main(argv, "composer-jax sft", "chat")
