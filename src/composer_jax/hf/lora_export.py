"""LoRA adapters (model/lora.py) -> a PEFT adapter directory: `adapter_config.json` and
`adapter_model.safetensors`, which `peft.PeftModel.from_pretrained` applies to the base exported
by `save_pretrained` (the DeepseekV3 / Qwen3-MoE layout of hf/weights.py).

PEFT's `lora_A.weight` is [r, in] and `lora_B.weight` [out, r] (torch's [out, in] of each factor as
an nn.Linear); our A [*in, r] and B [r, *out] take the base weight's layout on their input and
output side respectively: `heads_in` (q/q_b/kv_b [in, heads, head_dim]) flattens B's
[r, heads, head_dim] to [(heads head_dim), r], `heads_out` (o [heads, head_dim, embed]) flattens
A's [heads, head_dim, r] to [r, (heads head_dim)]. The scale is PEFT's `lora_alpha / r`, the same
as ours. The targets are listed as full module names (`model.layers.3.self_attn.q_b_proj`), so
PEFT adapts exactly the layers that have adapters (not the MTP modules, not the shared experts).

Only attention adapters are exported as a PEFT adapter. Routed experts: transformers 5 keeps a
DeepseekV3 layer's experts as fused [E, 2f, embed] parameters. Dense MLP (`mlp` target): PEFT 0.21
rewrites the `target_modules` of a deepseek_v3 / qwen3_moe model as if `gate_proj` / `up_proj` /
`down_proj` named the (v4-style, unfused) experts (peft/utils/transformers_weight_conversion.py),
so it wraps the fused experts instead of the dense layer's MLP and the adapter is not applied.
Export the merged model for those (`composer-jax convert --from-run ... --to-hf`).

`load_lora_run` reads a `train.lora` run's checkpoint for `composer-jax convert --from-run`: the
adapters from the checkpoint and the frozen base from where the run took it (the saved run
config's `train.init_from`, else the fresh model of its `train.seed`, as `rl/restore.py` does on a
resume), on one device. A run with a quantised base (`train.lora.base_format`) trained over the
base's block-format codes: its base here is that base dequantised (`model/quant_base.py`), the
float weights the trainer's forward computed with, so a merged export, the `--lora base` export
(PEFT's base) and a serve replica all reproduce the trainer's logits.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from composer_jax.config import Config, ConfigError, LoraConfig, ModelConfig
from composer_jax.hf.config import family_for
from composer_jax.hf.weights import Layout, T, layer_map_of
from composer_jax.sharding import ShardingRules

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


def _factor_layouts(layout: Layout) -> tuple[Layout, Layout]:
    """(A's layout, B's layout) for a base weight of `layout` (module docstring)."""
    if layout.kind == "heads_in":
        return T, layout
    if layout.kind == "heads_out":
        return layout, T
    return T, T


def peft_tensors(adapters: dict, cfg: ModelConfig) -> tuple[dict[str, np.ndarray], list[str]]:
    """(PEFT tensor name -> float32 host array, the adapted modules' full names) of `adapters`."""
    for stack in adapters.values():
        for block in stack:
            if block != "attn":
                raise ConfigError(
                    f"train.lora.targets has {'experts' if block == 'moe' else 'mlp'!r}: only attention "
                    f"adapters have a PEFT form here (module docstring); accepted: attention targets, or "
                    f"export the merged model (convert --from-run RUN --to-hf OUT --lora merged)"
                )
    family = family_for(cfg)
    tensors: dict[str, np.ndarray] = {}
    modules: list[str] = []
    for stack, first in (("dense_layers", 0), ("moe_layers", cfg.num_dense_layers)):
        if stack not in adapters:
            continue
        layer_map = layer_map_of(cfg, family, moe=stack == "moe_layers")
        for block, node in adapters[stack].items():
            for name, ab in node["lora"].items():
                suffix, layout = layer_map[(block, name)]
                module = suffix.removesuffix(".weight")
                a_layout, b_layout = _factor_layouts(layout)
                a, b = (np.asarray(jax.device_get(x), np.float32) for x in (ab["a"], ab["b"]))
                for li in range(a.shape[0]):
                    full = f"model.layers.{first + li}.{module}"
                    modules.append(full)
                    tensors[f"base_model.model.{full}.lora_A.weight"] = np.ascontiguousarray(a_layout.to_hf(a[li]))
                    tensors[f"base_model.model.{full}.lora_B.weight"] = np.ascontiguousarray(b_layout.to_hf(b[li]))
    return tensors, sorted(modules)


def save_peft_adapter(
    adapters: dict, cfg: ModelConfig, lora: LoraConfig, out_dir: str | os.PathLike, *, base_model: str = ""
) -> Path:
    """Write `adapters` as a PEFT LoRA adapter directory (module docstring); base_model: recorded
    as `base_model_name_or_path` (the exported base's directory or hub name)."""
    from safetensors.numpy import save_file

    tensors, modules = peft_tensors(adapters, cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model or None,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    return out


@dataclasses.dataclass(frozen=True)
class LoraRun:
    """A `train.lora` run's checkpoint, on one device: the run's config, the frozen base's plain
    parameter tree and the trained adapters (model/lora.py's tree)."""

    cfg: Config
    base: dict
    adapters: dict

    def merged(self) -> dict:
        """The adapted model as a plain parameter tree (W + alpha / rank A B)."""
        return self.merge(self.adapters)

    def merge(self, adapters: dict) -> dict:
        """`adapters` (this run's tree, e.g. a newer version from the weight store) merged into the
        base, on the base's shardings; the base is kept for the next version."""
        from composer_jax.model.lora import merged

        shardings = jax.tree.map(lambda x: x.sharding, self.base)
        scale = self.cfg.train.lora.scale
        return jax.jit(lambda b, a: merged(b, a, scale), out_shardings=shardings)(self.base, adapters)


def lora_run_config(saved: dict) -> Config | None:
    """The run config saved with a checkpoint, as a Config, when that run trained adapters
    (`train.lora.rank` > 0); else None (a full fine-tuning run's checkpoint holds the model)."""
    from composer_jax.config import config_from_dict

    if not int(((saved.get("train") or {}).get("lora") or {}).get("rank") or 0):
        return None
    return config_from_dict(saved, num_devices=None)


def load_lora_run(
    path: str | os.PathLike,
    step: int | None,
    saved: dict,
    *,
    with_base: bool = True,
    mesh: Mesh | None = None,
    rules: ShardingRules | None = None,
) -> LoraRun:
    """The adapters of checkpoint `path` (a checkpoint root or one step's directory) at `step`, and
    the frozen base they apply to (module docstring; `with_base=False`: an empty dict, for the PEFT
    adapter alone), on `mesh` by `rules` (None: on one device); `saved`: the run config saved with
    the step (`checkpoint.manager.read_run_config`). A base that cannot be read is a ConfigError
    naming train.init_from."""
    from jax.sharding import SingleDeviceSharding

    from composer_jax.checkpoint.manager import restore_params_only
    from composer_jax.hf.init_from import load_init_params
    from composer_jax.model.lora import abstract_adapters
    from composer_jax.model.params import abstract_params, init_params

    cfg = lora_run_config(saved)
    if cfg is None:
        raise ConfigError(f"{os.fspath(path)!r}: its run config has train.lora.rank=0; it holds the whole model")
    one = SingleDeviceSharding(jax.devices()[0])

    def placed(tree: Any) -> Any:
        if mesh is not None:
            return tree
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), tree)

    adapters = restore_params_only(path, placed(abstract_adapters(cfg.model, cfg.train.lora, mesh, rules)), step)
    if not with_base:
        return LoraRun(cfg, {}, adapters)
    if cfg.train.init_from:
        try:
            target = placed(abstract_params(cfg.model, mesh, rules))
            base, _record = load_init_params(cfg, mesh, rules, saved, target=target)
        except (OSError, ValueError) as e:  # ConfigError included: the run's base is where it was
            raise ConfigError(
                f"the LoRA run's frozen base, train.init_from={cfg.train.init_from!r} (its saved run config), "
                f"cannot be read: {e}; accepted: the checkpoint the run started from, at that path (run the "
                "command from the directory the run was started in)"
            ) from None
    else:  # the fresh model of train.seed, as the run made it (threefry keys: any sharding, the same values)
        base = init_params(cfg.model, jax.random.key(cfg.train.seed), mesh, rules)
    fmt = cfg.train.lora.base_format
    if fmt != "none":  # what the trainer computed with: the quantised base, dequantised (module docstring)
        from composer_jax.model.quant_base import dequantized_base, quantized_base

        quantised = quantized_base(base, cfg.model, fmt, mesh, rules)
        base = dequantized_base(quantised, mesh, cfg.model, rules)
    return LoraRun(cfg, base, adapters)
