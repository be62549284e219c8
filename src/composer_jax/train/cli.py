"""`composer-jax pretrain|sft --config FILE [key=value ...]`: run one training stage.

Multi-host: the same command on every host. With --coordinator/--num-processes/--process-id (or
the JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID environment variables, or a
cluster JAX detects by itself such as SLURM), `jax.distributed.initialize` joins the processes
before anything else touches JAX; each process then feeds its own slice of the batch.
"""

from __future__ import annotations

import argparse
import json
import os

from composer_jax.errors import UsageError, UserError


def _parser(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="stage YAML, e.g. configs/pretrain/tiny_stage1.yaml")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=10 mesh.fsdp=2")
    ap.add_argument("--stop-after", type=int, default=None, help="stop after N steps of this run (crash test)")
    add_jax_args(ap)
    return ap


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
