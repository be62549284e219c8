"""The `rl.vllm` section: vLLM replicas as the learner's rollout sampler (`rl.sampler_engine: vllm`).

The learner drives each replica through vLLM's token-in/token-out `POST /inference/v1/generate`
(rl/samplers/vllm.py) and gives it each new policy version one of two ways (`weight_update`):

* `restart` - the version is exported as a Hugging Face checkpoint and the replica restarted on it
  (rl/samplers/vllm_launch.py). The only correct weight change on vLLM's CPU backend (its
  `reload_weights` repacks MoE weights and then serves wrong tokens); only for replicas the run
  starts itself (`rl.local_samplers`).
* `nccl` - vLLM's weight-transfer routes (`/init_weight_transfer_engine`, `/start_weight_update`,
  `/update_weights`, `/finish_weight_update`) with an NCCL group the trainer joins as rank 0
  (GPU replicas, `rl.sampler_urls`).

Example (YAML):

    rl:
      sampler_engine: vllm
      local_samplers: 1
      vllm:
        python: .venv/vllm/bin/python   # the interpreter of vLLM's own virtualenv (`make venv`)
        dtype: float32
        attention_backend: auto          # CPU_MLA on vLLM's CPU backend (its AMX kernel takes no tiny heads)
        enforce_eager: true              # no torch.compile: a restart per version is then ~1 s of engine start
        kv_cache_bytes: 512M
        routed_experts: false            # --enable-return-routed-experts (router replay; needs Triton on CPU)
        weight_update: restart
        extra_args: []                   # more `vllm serve` arguments (a --compilation-config is merged, below)

On vLLM's CPU build the replicas start with `--compilation-config '{"custom_ops":
["-rotary_embedding"]}'` (rl/samplers/vllm_launch.py: that build's rotary-embedding op rotates MLA's
query wrongly). A `--compilation-config` (or `-cc`) in `extra_args` is merged with it, not replaced
by it: give it as one JSON object; its keys are kept, and `-rotary_embedding` is added to its
`custom_ops` unless they name `rotary_embedding` themselves (`+rotary_embedding` turns the op back
on). vLLM's dotted form (`--compilation-config.KEY V`) is refused: vLLM assembles it into a
config of its own that would replace the merged one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from typing import Any, Literal

from composer_jax.errors import ConfigError

WeightUpdate = Literal["restart", "nccl"]
WEIGHT_UPDATES = ("restart", "nccl")
VLLM_DTYPES = ("float32", "bfloat16")
VLLM_QUANTIZATIONS = ("", "fp8")
_SIZE = re.compile(r"^\d+(\.\d+)?[KMGT]?$")
COMPILATION_FLAGS = ("--compilation-config", "-cc")  # vLLM's flag and its short form


@dataclasses.dataclass(frozen=True)
class VLLMConfig:
    # the interpreter of the virtualenv vLLM is installed in (a relative path is from the run's
    # working directory); local replicas only
    python: str = ".venv/vllm/bin/python"
    dtype: str = "float32"  # vLLM's --dtype, and the dtype of the checkpoints exported for it
    # vLLM's --quantization: "" = none (weights at `dtype`), "fp8" = block-scaled FP8 as the DeepSeek /
    # Kimi hub checkpoints (`composer-jax inspect` sizes a replica at this precision)
    quantization: str = ""
    # vLLM's --attention-backend; "auto": CPU_MLA on vLLM's CPU build (its AMX MLA kernel refuses
    # heads narrower than 32), vLLM's own choice elsewhere
    attention_backend: str = "auto"
    enforce_eager: bool = True  # --enforce-eager: no torch.compile at each (re)start
    kv_cache_bytes: str = "512M"  # --kv-cache-memory-bytes (CPU: the KV cache's memory)
    # --enable-return-routed-experts: each answer carries the experts of every position, replayed
    # in the training forward (rl.loss.router_replay); off, replay is turned off for the run
    routed_experts: bool = False
    weight_update: WeightUpdate = "restart"
    # NCCL transfers (weight_update: nccl): the address replicas reach the trainer's rank 0 at
    nccl_host: str = ""
    extra_args: tuple[str, ...] = ()  # more `vllm serve` arguments, last (a repeated flag overrides)
    start_timeout_s: float = 900.0  # one replica's (re)start: imports, model load, first request

    def __post_init__(self) -> None:
        if isinstance(self.extra_args, str):
            object.__setattr__(self, "extra_args", (self.extra_args,))
        object.__setattr__(self, "extra_args", tuple(self.extra_args))
        validate_vllm(self)


def validate_vllm(v: VLLMConfig, prefix: str = "rl.vllm") -> None:
    """The section's checks; errors name `prefix`.KEY."""
    if not isinstance(v.python, str) or not v.python:
        raise ConfigError(f"{prefix}.python={v.python!r}: expected the path of vLLM's Python interpreter")
    if v.dtype not in VLLM_DTYPES:
        raise ConfigError(f"{prefix}.dtype={v.dtype!r} is not accepted; accepted: {', '.join(VLLM_DTYPES)}")
    if v.quantization not in VLLM_QUANTIZATIONS:
        raise ConfigError(f"{prefix}.quantization={v.quantization!r} is not accepted; accepted: '' (none) or 'fp8'")
    if not isinstance(v.attention_backend, str) or not v.attention_backend:
        raise ConfigError(f"{prefix}.attention_backend={v.attention_backend!r}: expected auto or a vLLM backend name")
    for key in ("enforce_eager", "routed_experts"):
        if not isinstance(getattr(v, key), bool):
            raise ConfigError(f"{prefix}.{key}={getattr(v, key)!r}: expected true or false")
    if not isinstance(v.kv_cache_bytes, str) or not _SIZE.match(v.kv_cache_bytes):
        raise ConfigError(
            f"{prefix}.kv_cache_bytes={v.kv_cache_bytes!r}: expected bytes such as 512M, 4G or 1073741824"
        )
    if v.weight_update not in WEIGHT_UPDATES:
        raise ConfigError(
            f"{prefix}.weight_update={v.weight_update!r} is not accepted; accepted: {', '.join(WEIGHT_UPDATES)}"
        )
    if not all(isinstance(a, str) for a in v.extra_args):
        raise ConfigError(f"{prefix}.extra_args={list(v.extra_args)!r}: expected a list of strings")
    split_compilation_config(v.extra_args, prefix)
    t = v.start_timeout_s
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or not t > 0:
        raise ConfigError(f"{prefix}.start_timeout_s={t!r}: expected seconds > 0")


def split_compilation_config(
    extra_args: Sequence[str], prefix: str = "rl.vllm"
) -> tuple[list[str], dict[str, Any] | None]:
    """`extra_args` without their `--compilation-config` / `-cc` (`FLAG JSON` or `FLAG=JSON`), and
    its JSON object (the last one when repeated, as vLLM reads them; None when absent). A
    ConfigError for a value that is not a JSON object with a list of strings as `custom_ops`, or
    for vLLM's dotted form (module docstring)."""
    rest: list[str] = []
    found: dict[str, Any] | None = None
    args = list(extra_args)
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        name = "--" + name[2:].replace("_", "-") if name.startswith("--") else name
        if name.startswith(tuple(f + "." for f in COMPILATION_FLAGS)):
            raise ConfigError(
                f"{prefix}.extra_args: {arg!r}: give the compilation config as one JSON object "
                "(--compilation-config '{...}'), which is merged with the replicas' own"
            )
        if name not in COMPILATION_FLAGS:
            rest.append(arg)
            i += 1
            continue
        if not eq:
            if i + 1 == len(args):
                raise ConfigError(f"{prefix}.extra_args: {arg} has no value; expected a JSON object after it")
            value, i = args[i + 1], i + 1
        found = _compilation_object(value, f"{prefix}.extra_args: {name}")
        i += 1
    return rest, found


def _compilation_object(text: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ConfigError(f'{where} {text!r}: expected a JSON object such as \'{{"custom_ops": ["+rms_norm"]}}\'')
    ops = value.get("custom_ops", [])
    if not isinstance(ops, list) or not all(isinstance(op, str) for op in ops):
        raise ConfigError(f"{where} {text!r}: custom_ops must be a list of strings")
    return value
