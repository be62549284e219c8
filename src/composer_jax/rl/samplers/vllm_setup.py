"""The learner's vLLM samplers (`rl.sampler_engine: vllm`): what the run changes for them, and their start.

`with_vllm_settings` is applied to the run's config before the learner is built: without routed
experts from the replicas (`rl.vllm.routed_experts: false`, the CPU build's case: vLLM records them
with a Triton kernel), router replay is turned off for the run and the run says so.
`start_vllm` starts `rl.local_samplers` replicas (rl/vllm_launch.py) on the run's first version,
exported as a Hugging Face checkpoint, or connects to `rl.sampler_urls` replicas that take versions
over NCCL (rl/vllm_nccl.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from composer_jax.config import Config
from composer_jax.rl.samplers.vllm import VLLMTokenPolicy
from composer_jax.rl.samplers.vllm_replicas import (
    CheckpointExports,
    LocalVLLM,
    RestartPush,
    check_python,
    is_cpu_build,
    needs_padding,
)


def with_vllm_settings(cfg: Config, echo: Callable[[str], None]) -> Config:
    """`cfg` as a run with vLLM samplers trains it (module docstring); unchanged for other engines."""
    r = cfg.rl
    if r.sampler_engine != "vllm" or r.vllm.routed_experts:
        return cfg
    if r.loss.router_replay and cfg.model.num_moe_layers > 0:
        echo(
            "[rl] router replay off: the vLLM replicas return no routed experts (rl.vllm.routed_experts=false; "
            "vLLM's CPU build cannot record them); the training forward routes by itself"
        )
        loss = dataclasses.replace(r.loss, router_replay=False)
        return dataclasses.replace(cfg, rl=dataclasses.replace(r, loss=loss))
    return cfg


async def start_vllm(
    stack: contextlib.AsyncExitStack,
    cfg: Config,
    policy_args: dict[str, Any],
    out_dir: Path,
    echo: Callable[[str], None],
) -> tuple[list[VLLMTokenPolicy], Any, LocalVLLM | None]:
    """The run's vLLM policies, what each new version is handed to first (`export(params, version)`:
    the checkpoints restarts read, or the NCCL push's next weights) and the launcher of local replicas."""
    r, v, t = cfg.rl, cfg.rl.vllm, cfg.train
    tok, version, params = policy_args["tok"], int(policy_args["version"]), policy_args["params"]
    token = r.sampler_token or os.environ.get("COMPOSER_JAX_SAMPLER_TOKEN", "")
    if r.sampler_urls:  # running replicas (GPU fleets): versions over NCCL
        from composer_jax.rl.samplers.vllm_nccl import NCCLPush

        nccl = NCCLPush(cfg, host=v.nccl_host)
        policies = [
            VLLMTokenPolicy(u, tok, max_context=t.seq_len, weights=nccl, routed_experts=v.routed_experts, api_key=token)
            for u in r.sampler_urls
        ]
        for i, p in enumerate(policies):
            p.index = i
            stack.push_async_callback(p.aclose)
        await nccl.connect(policies, params, version)
        echo(f"[rl] {len(policies)} vLLM replica(s) by URL, versions over NCCL: {', '.join(r.sampler_urls)}")
        return policies, nccl, None
    python = check_python(v.python)
    cpu = is_cpu_build(python)
    pad = needs_padding(cfg.model, cpu)
    if pad:
        echo("[rl] MLA padded exactly to 512 + 64 in the checkpoints for vLLM (its CPU MLA kernel's widths)")
    exports = CheckpointExports(out_dir / "vllm_weights", cfg.model, v.dtype, pad=pad)
    model_dir = exports.export(params, version)
    cores = sorted(os.sched_getaffinity(0))[1 : 1 + r.local_samplers] if r.pin_cores else None
    launcher = LocalVLLM(
        v,
        r.local_samplers,
        model_dir=model_dir,
        version=version,
        max_model_len=t.seq_len,
        cpu=cpu,
        cores=cores,
        log_dir=out_dir / "samplers",
    )
    urls = stack.enter_context(launcher)
    push = RestartPush(launcher, exports)
    policies = [
        VLLMTokenPolicy(u, tok, max_context=t.seq_len, weights=push, routed_experts=v.routed_experts, index=i)
        for i, u in enumerate(urls)
    ]
    for p in policies:
        p.version = version
    echo(
        f"[rl] started {len(urls)} vLLM replica(s) ({'CPU build' if cpu else 'GPU build'}, {python}): "
        f"{', '.join(urls)}; new versions by restart"
    )
    return policies, exports, launcher
