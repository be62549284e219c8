"""`composer-jax rl` (the learner) and `composer-jax eval` (the agent without training).

    composer-jax rl --config configs/rl/tiny_pick.yaml [key=value ...]
    composer-jax rl --config C --coordinator HOST:PORT --num-processes N --process-id I [key=value ...]
    composer-jax eval --tasks tasks --checkpoint runs/tiny/stage3/checkpoints --samples 4 --out runs/eval
    composer-jax eval --tasks tasks --endpoint http://127.0.0.1:8000/v1 --model composer --samples 4 --out runs/eval

Without --env-url, both start local environment servers on --tasks / rl.tasks_dir (the embedded
default); with URLs they use those servers (token: --env-token or COMPOSER_JAX_ENV_TOKEN).
A multi-host trainer runs the same `rl` command on every host (as `pretrain`): process 0 runs the
rollout side and hands each step's batch to the others; its samplers are `serve` replicas
(rl.sampler_urls or rl.local_samplers).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from composer_jax.errors import UsageError, UserError


def _rl_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="composer-jax rl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", required=True, help="RL YAML, e.g. configs/rl/tiny_pick.yaml")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rl.group_size=8 train.steps=20")
    ap.add_argument("--stop-after", type=int, default=None, help="stop after N steps of this run (crash test)")
    from composer_jax.train.cli import add_jax_args, add_placement_args

    add_placement_args(ap, fleet=", and its environment servers and sampler replicas as Ray actors too (rl.ray)")
    add_jax_args(ap)  # multi-host trainer: the same command on every host (docs/scaling.md)
    return ap


def _fleet_resources(cfg: Any) -> list[dict[str, float]]:
    from composer_jax.rl.rollout.side import fleet_resources  # here: it imports the rollout side

    return fleet_resources(cfg)


def rl_main(argv: list[str] | None = None) -> int:
    args = _rl_parser().parse_args(argv)
    from composer_jax.train.cli import init_jax, place_trainer, placement_overrides

    if (status := place_trainer("rl", args, _fleet_resources)) is not None:
        return status
    init_jax(args)
    from composer_jax.config import load_config
    from composer_jax.multihost import ProcessZeroFailed
    from composer_jax.rl.learner import run_rl

    try:
        cfg = load_config(args.config, [*args.overrides, *placement_overrides(args, rl=True)])
        summary = run_rl(cfg, stop_after=args.stop_after)
    # the user's faults only (errors.py `UserError`: a config value, a checkpoint or file it names,
    # environment servers that cannot start); any other exception, a ValueError or a
    # FileNotFoundError too, is a bug and keeps its traceback
    except UserError as e:
        raise UsageError(str(e)) from e
    except ProcessZeroFailed as e:  # a process of a multi-host trainer: process 0's error (it prints the details)
        print(f"composer-jax rl: {e}", file=sys.stderr)
        return 1
    last = summary["steps"].get(max(summary["steps"], default=0), {})
    print(
        json.dumps(
            {
                "final_step": summary.get("stopped_at", summary["final_step"]),
                "dropped_stale_groups": len(summary["dropped_stale_groups"]),
                "trainer_idle_fraction": round(summary["trainer_idle_fraction"], 4),
                "trained_groups": {str(n): ids for n, ids in sorted(summary["trained_groups"].items())},
                **{k: last[k] for k in sorted(last) if k.startswith(("reward/", "rollout/", "staleness/"))},
            }
        )
    )
    return 0


def _eval_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="composer-jax eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--tasks", required=True, help="task directory (local servers run it; with --env-url, its ids are used)"
    )
    ap.add_argument("--task", action="append", default=[], help="evaluate only this task id (repeatable)")
    ap.add_argument("--family", action="append", default=[], help="a generated family gen/NAME (repeatable)")
    ap.add_argument("--family-seeds", type=int, default=8, help="seeds per family (from --seed-base)")
    ap.add_argument("--seed-base", type=int, default=1_000_000, help="first family seed (held out from training's)")
    ap.add_argument("--samples", type=int, default=4, help="rollouts per task (K of best-of-K)")
    ap.add_argument(
        "--out",
        required=True,
        help="output directory: report.json, trajectories.jsonl, predictions.jsonl (sample 0: a submission), "
        "predictions.oracle.jsonl (best-of-K: not one)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=16, help="rollouts in flight")
    ap.add_argument("--env-url", action="append", default=[], help="environment server URL (repeatable)")
    ap.add_argument("--env-token", default=None, help="environment server token (default: COMPOSER_JAX_ENV_TOKEN)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="the policy in process: a checkpoint directory (as `serve`)")
    src.add_argument("--endpoint", help="the policy behind an OpenAI-compatible base URL, e.g. http://host:8000/v1")
    ap.add_argument("--model", default="", help="--endpoint: the model name to request")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""), help="--endpoint: bearer key")
    ap.add_argument("--step", type=int, default=None, help="--checkpoint: training step (default: the latest)")
    ap.add_argument("--tokenizer", default=None, help="--checkpoint: tokenizer (default: next to it / its run config)")
    ap.add_argument("--slots", type=int, default=16, help="--checkpoint: sampler slots")
    ap.add_argument("--max-len", type=int, default=4096, help="context of one generation")
    ap.add_argument("agent", nargs="*", help="agent.key=value overrides, e.g. agent.max_turns=8")
    return ap


def _agent_config(overrides: list[str]) -> Any:
    from composer_jax.config import AgentConfig, ConfigError, build_dataclass, parse_overrides, set_path

    tree: dict[str, Any] = {}
    for path, value in parse_overrides(overrides):
        if not path or path[0] != "agent":
            raise ConfigError(f"eval takes agent.KEY=VALUE overrides only; got {'.'.join(path)!r}")
        set_path(tree, path, value)
    return build_dataclass(AgentConfig, tree.get("agent", {}), "agent")


async def _evaluate(args: argparse.Namespace, policy: Any, urls: list[str], token: str, agent: Any) -> dict:
    from composer_jax.env.api.client import EnvClient
    from composer_jax.rl.evaluate import format_table, report, write_outputs
    from composer_jax.rl.rollout.tasks import TaskRef, sample_tasks

    async with EnvClient(urls, token) as client:
        listed = await client.list_tasks()
        known = {t["task_id"]: t for t in listed["tasks"] if t.get("runnable")}
        names = args.task or sorted(known)
        unknown = [n for n in names if n not in known]
        if unknown:
            raise UsageError(
                f"--task: task(s) {unknown} are not runnable on the environment server(s); runnable: {sorted(known)}"
            )
        bad = [f for f in args.family if f not in listed.get("families", [])]
        if bad:
            raise UsageError(f"--family: famil(ies) {bad} unknown; accepted: {listed.get('families', [])}")
        tasks = [TaskRef.from_listing(known[n]) for n in names]
        tasks += [TaskRef(f, args.seed_base + i, f) for f in args.family for i in range(args.family_seeds)]
        results = await sample_tasks(
            policy, client, tasks, args.samples, agent, seed=args.seed, concurrency=args.concurrency
        )
    name = args.model or (Path(args.checkpoint).name if args.checkpoint else "endpoint")
    paths = write_outputs(results, args.out, name)
    rep = report(results)
    print(format_table(rep), file=sys.stderr)  # stdout stays one JSON document
    return {"overall": rep["overall"], "files": {k: str(v) for k, v in paths.items()}}


def eval_main(argv: list[str] | None = None) -> int:
    args = _eval_parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from composer_jax.config import ConfigError
    from composer_jax.rl.rollout.env_servers import LocalEnvServers

    try:
        agent = _agent_config(args.agent)
        if args.samples < 1:
            raise ConfigError(f"--samples {args.samples}: give at least 1")
        policy, closer = _policy(args)
        with contextlib.ExitStack() as stack:
            if args.env_url:
                urls, token = args.env_url, args.env_token or os.environ.get("COMPOSER_JAX_ENV_TOKEN", "")
            else:
                urls, token = stack.enter_context(LocalEnvServers(args.tasks))
            out = asyncio.run(_run_and_close(_evaluate(args, policy, urls, token, agent), closer))
    except UserError as e:  # the user's only, as in rl_main
        raise UsageError(str(e)) from e
    print(json.dumps(out, indent=2))
    return 0


async def _run_and_close(job: Any, closer: Any) -> Any:
    try:
        return await job
    finally:
        await closer()


def _policy(args: argparse.Namespace) -> tuple[Any, Any]:
    """(policy, async close) for --endpoint or --checkpoint."""
    from composer_jax.config import ConfigError

    if args.endpoint:
        from composer_jax.rl.samplers.policy import OpenAIPolicy

        if not args.model:
            raise ConfigError("--endpoint needs --model, the model name the endpoint serves (see its /v1/models)")
        p = OpenAIPolicy(args.endpoint, args.model, api_key=args.api_key, max_context=args.max_len)
        return p, p.aclose
    from composer_jax.formats.tokenizer import load_tokenizer
    from composer_jax.inference.engine.asyncio_sampler import AsyncSampler
    from composer_jax.inference.engine.batch_sampler import Sampler, SamplerSettings
    from composer_jax.inference.server.policy import load_policy
    from composer_jax.rl.samplers.in_process import TokenPolicy

    loaded = load_policy(args.checkpoint, step=args.step, key="--checkpoint")
    where = args.tokenizer or loaded.tokenizer_hint
    if where is None:
        raise ConfigError(f"no tokenizer found for {args.checkpoint!r}; pass --tokenizer PATH")
    tok = load_tokenizer(where)
    max_len = min(args.max_len, loaded.cfg.max_position_embeddings)
    sampler = AsyncSampler(Sampler(loaded.params, loaded.cfg, SamplerSettings(slots=args.slots, max_len=max_len)))
    return TokenPolicy(sampler, tok), sampler.aclose
