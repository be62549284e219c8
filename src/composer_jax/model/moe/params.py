"""One MoE block's parameters (router, routed experts, shared expert) as `ParamSpec`s: the model's
parameter tree (`model/params.py`) stacks them, and `layer.py` builds its `shard_map` specs from
their logical axes."""

from __future__ import annotations

from composer_jax.config import ModelConfig
from composer_jax.specs import ParamSpec


def moe_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """One MoE block's parameters (router, routed experts, shared expert), unstacked."""
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    specs = {
        # the router runs in float32 whatever the parameter dtype (as DeepSeek / HF keep it)
        "router": ParamSpec((d, e), ("embed", "router_experts"), dtype="float32"),
        "router_bias": ParamSpec((e,), ("router_experts",), "zeros", dtype="float32", role="router_bias"),
        "gate": ParamSpec((e, d, f), ("experts", "embed", "expert_mlp")),
        "up": ParamSpec((e, d, f), ("experts", "embed", "expert_mlp")),
        "down": ParamSpec((e, f, d), ("experts", "expert_mlp", "embed")),
    }
    if cfg.num_shared_experts:
        fs = cfg.shared_intermediate_size  # the shared expert: a dense SwiGLU MLP beside the routed ones
        specs["shared_gate"] = ParamSpec((d, fs), ("embed", "mlp"))
        specs["shared_up"] = ParamSpec((d, fs), ("embed", "mlp"))
        specs["shared_down"] = ParamSpec((fs, d), ("mlp", "embed"))
    return specs
