"""`train.lora`: low-rank adapters (LoRA, Hu et al. 2021, arXiv 2106.09685) over a frozen base.

With `rank` > 0 the run trains only the adapters: every targeted projection W [*in, *out] gets
A [*in, rank] and B [rank, *out] (B zero at the start, so the adapted model starts as the base)
and computes x W + (alpha / rank) x A B. The base stays frozen; the optimiser state, the
checkpoints and the publishes to samplers hold the adapters only (`model/lora.py`)."""

from __future__ import annotations

import dataclasses

from composer_jax.config.model import ModelConfig
from composer_jax.errors import ConfigError

# target names: the attention projections by their parameter names (model/params.py), "attention"
# for all of the model's, "mlp" for the dense layers' SwiGLU (gate/up/down), "experts" for the
# routed experts' (gate/up/down of every expert, one adapter pair per expert)
ATTENTION_TARGETS = {"mla": ("q", "q_a", "q_b", "kv_a", "kv_b", "o"), "gqa": ("q", "k", "v", "o")}
GROUP_TARGETS = ("attention", "mlp", "experts")
# the frozen base's storage (model/quant_base.py): none = as loaded (float); the block formats
# of quant/formats.py otherwise, dequantised in the forward one layer at a time (QLoRA)
BASE_FORMATS = ("none", "mxfp8", "mxfp4", "nvfp4")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """rank: 0 = off (full fine-tuning); alpha: the scale is alpha / rank (PEFT's `lora_alpha`);
    targets: what gets adapters (module docstring, `ATTENTION_TARGETS`, `GROUP_TARGETS`);
    dropout: only 0 (the RL objective scores the sampler's exact policy: a dropout would train
    another one); base_format: how the frozen base is stored (`BASE_FORMATS`, model/quant_base.py:
    the layers' linear kernels in a block format, dequantised in the forward)."""

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[str, ...] = ("attention",)
    dropout: float = 0.0
    base_format: str = "none"

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0


def validate_lora(c: LoraConfig) -> None:
    """The section's own checks (the targets against the model: `lora_targets`)."""
    if c.rank < 0:
        raise ConfigError(f"train.lora.rank={c.rank} must be >= 0 (0 = no adapters, full fine-tuning)")
    if c.rank and c.alpha <= 0:
        raise ConfigError(f"train.lora.alpha={c.alpha} must be > 0 (the adapters' scale is alpha / rank)")
    if c.dropout != 0.0:
        raise ConfigError(
            f"train.lora.dropout={c.dropout} is not supported; accepted: 0 (the objective must score "
            f"the sampled policy itself)"
        )
    if c.base_format not in BASE_FORMATS:
        raise ConfigError(
            f"train.lora.base_format={c.base_format!r} is not accepted; accepted: {', '.join(BASE_FORMATS)}"
        )
    if c.base_format != "none" and not c.rank:
        raise ConfigError(
            f"train.lora.base_format={c.base_format!r} needs adapters (train.lora.rank > 0): a quantised "
            f"base is frozen, and with rank 0 the whole model is trained; accepted with rank 0: none"
        )
    known = set(GROUP_TARGETS) | {t for names in ATTENTION_TARGETS.values() for t in names}
    bad = [t for t in c.targets if t not in known]
    if bad or (c.rank and not c.targets):
        raise ConfigError(
            f"train.lora.targets={list(c.targets)} is not accepted; accepted: a non-empty list of {sorted(known)}"
        )


def lora_targets(c: LoraConfig, m: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The adapted parameters by block: {"attn": projection names, "mlp": ("gate", "up", "down") or
    (), "moe": ("gate", "up", "down") or ()}; a target the model does not have is refused naming
    the model's."""
    have = _attention_names(m)
    attn: list[str] = []
    for t in c.targets:
        if t == "attention":
            attn += [n for n in have if n not in attn]
        elif t not in GROUP_TARGETS:
            if t not in have:
                raise ConfigError(
                    f"train.lora.targets names {t!r}, which this model ({m.attention_type}"
                    f"{', q_lora_rank ' + str(m.q_lora_rank) if m.attention_type == 'mla' else ''}) does "
                    f"not have; accepted: {list(have) + list(GROUP_TARGETS)}"
                )
            if t not in attn:
                attn.append(t)
    if "experts" in c.targets and not m.num_experts:
        raise ConfigError("train.lora.targets names 'experts' but the model is dense (model.num_experts=0)")
    if "mlp" in c.targets and not m.num_dense_layers:
        raise ConfigError(
            "train.lora.targets names 'mlp' but the model has no dense layer (model.first_k_dense=0); "
            "the MoE layers' routed experts are 'experts'"
        )
    return {
        "attn": tuple(attn),
        "mlp": ("gate", "up", "down") if "mlp" in c.targets else (),
        "moe": ("gate", "up", "down") if "experts" in c.targets else (),
    }


def _attention_names(m: ModelConfig) -> tuple[str, ...]:
    if m.attention_type == "gqa":
        return ATTENTION_TARGETS["gqa"]
    q = ("q_a", "q_b") if m.q_lora_rank else ("q",)
    return q + ("kv_a", "kv_b", "o")
