"""A small MoE configuration, its parameters and a per-token numpy reference, shared by the MoE,
expert-parallel and GPU-lowering tests."""

import jax
import numpy as np

from composer_jax.config import ModelConfig


def moe_cfg(**kw):
    base = dict(
        hidden_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        num_shared_experts=1,
        n_group=4,
        topk_group=2,
        topk_method="noaux_tc",
        score_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    base.update(kw)
    return ModelConfig(**base)


def numpy_moe(p, x, cfg, experts, weights):
    """Per-token loop reference for the routed + shared expert output."""
    y = np.zeros_like(x)
    silu = lambda v: v / (1 + np.exp(-v))
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = experts[t, j]
            h = silu(x[t] @ p["gate"][e]) * (x[t] @ p["up"][e])
            y[t] += weights[t, j] * (h @ p["down"][e])
        h = silu(x[t] @ p["shared_gate"]) * (x[t] @ p["shared_up"])
        y[t] += h @ p["shared_down"]
    return y


def moe_params(cfg, key):
    ks = jax.random.split(key, 8)
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    n = lambda k, s: 0.3 * jax.random.normal(k, s)
    return {
        "router": n(ks[0], (d, e)),
        "router_bias": 0.1 * jax.random.normal(ks[1], (e,)),
        "gate": n(ks[2], (e, d, f)),
        "up": n(ks[3], (e, d, f)),
        "down": n(ks[4], (e, f, d)),
        "shared_gate": n(ks[5], (d, f)),
        "shared_up": n(ks[6], (d, f)),
        "shared_down": n(ks[7], (f, d)),
    }
