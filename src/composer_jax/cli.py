"""`composer-jax` command-line entry point: one subcommand per job.

Each subcommand lives in the module that owns the job and is imported only when it runs, so that
`composer-jax env-server` never imports JAX. A subcommand signals a fault in what it was given by
raising `UsageError`; this is the one place that turns it into a message and exit code 2.
"""

from __future__ import annotations

import importlib
import sys

from composer_jax.errors import UsageError

# subcommand -> (module, function taking argv list and returning an exit code, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("composer_jax.demo", "main", "build a small model on the fake mesh, run a sharded step, print its report"),
    "pretrain": ("composer_jax.train.cli", "pretrain_main", "continued pretraining stage (data.format=pretrain)"),
    "sft": ("composer_jax.train.cli", "sft_main", "supervised fine-tuning stage (data.format=chat)"),
    "inspect": ("composer_jax.inspection", "main", "parameter counts, FLOPs/token and per-device memory of a config"),
    "convert": ("composer_jax.hf.convert", "main", "convert between Hugging Face safetensors and composer_jax"),
    "serve": ("composer_jax.inference.server.cli", "serve_main", "OpenAI-compatible HTTP server over a checkpoint"),
    "sample": (
        "composer_jax.inference.server.cli",
        "sample_main",
        "sample a completion from a checkpoint and print it",
    ),
    "env-server": ("composer_jax.env.cli", "env_server_main", "serve sandboxed coding environments over HTTP"),
    "env": ("composer_jax.env.cli", "env_main", "environment task tools (env validate DIR)"),
    "tokenizer": (
        "composer_jax.data.tokenizer_cli",
        "main",
        "train a byte-level BPE on code (tokenizer train), try one (tokenizer encode)",
    ),
    "rl": ("composer_jax.rl.cli", "rl_main", "reinforcement learning against environment servers (configs/rl/)"),
    "eval": (
        "composer_jax.rl.cli",
        "eval_main",
        "the agent on tasks without training: pass@1, best-of-K, trajectories",
    ),
    "vllm-replica": (
        "composer_jax.rl.samplers.vllm_child",
        "main",
        "one vLLM server (its own virtualenv) as a supervised sampler replica of a run",
    ),
    "report": ("composer_jax.report", "main", "a run directory's Markdown report with PNG plots (loss, reward, eval)"),
    "data": ("composer_jax.data.cli", "main", "data tools: make-sft from Harbor tasks, peek at packed batches"),
}


def _usage() -> str:
    lines = ["usage: composer-jax COMMAND [args...]", "", "commands:"]
    for name, (_, _, help_) in SUBCOMMANDS.items():
        lines.append(f"  {name:<12} {help_}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"composer-jax: unknown command {name!r}; accepted: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    module, func, _ = SUBCOMMANDS[name]
    try:
        return int(getattr(importlib.import_module(module), func)(rest) or 0)
    except UsageError as e:
        print(f"composer-jax {name}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
