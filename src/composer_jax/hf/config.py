"""Hugging Face `config.json` <-> `ModelConfig` for deepseek_v3 (and Kimi K2), deepseek_v2, qwen3_moe.

Import reads both the transformers-5 spelling (`rope_parameters` holding `rope_theta`) and the hub /
remote-code spelling (`rope_scaling` plus top-level `rope_theta`, `scoring_func`, `topk_method`).
Every value our model cannot reproduce exactly is refused with a ConfigError naming the key; keys
that do not change the forward pass (token ids, aux-loss coefficients, `ep_size`, ...) are ignored.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Any

from composer_jax.config import ConfigError, ModelConfig, RopeScalingConfig, validate_model
from composer_jax.config.model import as_dtype

log = logging.getLogger(__name__)

# model_type -> family. Kimi K2 ships model_type "kimi_k2" with DeepSeek-V3 remote code.
MODEL_TYPES = {
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "deepseek_v2": "deepseek_v2",
    "qwen3_moe": "qwen3_moe",
}
ARCHITECTURES = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


@dataclasses.dataclass(frozen=True)
class HFInfo:
    """What config.json says beyond ModelConfig: the family, the MTP depth it asks for (loaded only if
    the tensors exist), and FP8 block quantisation of the stored weights."""

    family: str
    requested_mtp_layers: int = 0
    fp8_block: tuple[int, int] | None = None
    dtype: str = "float32"


def _get(hf: Mapping[str, Any], key: str, default: Any = None) -> Any:
    v = hf.get(key, default)
    return default if v is None else v


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _rope(hf: Mapping[str, Any]) -> tuple[float, RopeScalingConfig]:
    """(rope_theta, RopeScalingConfig) from `rope_parameters` (transformers 5) or `rope_scaling`."""
    params = dict(_get(hf, "rope_parameters", {}) or {})
    legacy = dict(_get(hf, "rope_scaling", {}) or {})
    rp = {**legacy, **params}
    theta = float(rp.get("rope_theta", _get(hf, "rope_theta", 10000.0)))
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind in ("default", None):
        return theta, RopeScalingConfig()
    _require(kind == "yarn", f"config.json: rope type {kind!r} is not supported; accepted: default, yarn")
    _require(
        float(_get(rp, "partial_rotary_factor", 1.0)) == 1.0,
        f"config.json: rope partial_rotary_factor={rp.get('partial_rotary_factor')} is not supported (1.0 only)",
    )
    factor = float(rp["factor"])
    orig = int(_get(rp, "original_max_position_embeddings", hf.get("max_position_embeddings", 4096)))
    mscale = float(_get(rp, "mscale", 0.0))
    mscale_all_dim = float(_get(rp, "mscale_all_dim", 0.0))
    scaling = RopeScalingConfig(
        type="yarn",
        factor=factor,
        original_max_position_embeddings=orig,
        beta_fast=float(_get(rp, "beta_fast", 32.0)) or 32.0,
        beta_slow=float(_get(rp, "beta_slow", 1.0)) or 1.0,
        # transformers uses the mscale/mscale_all_dim ratio only when both are nonzero, else
        # mscale(factor); our model makes the same choice, so absent stays 0
        mscale=mscale,
        mscale_all_dim=mscale_all_dim,
        truncate=bool(_get(rp, "truncate", True)),
    )
    if rp.get("attention_factor") is not None:
        from composer_jax.model.layers import rope_frequencies  # local: keep config import light

        ours = rope_frequencies(2, theta, scaling)[1]
        _require(
            math.isclose(float(rp["attention_factor"]), ours, rel_tol=1e-6),
            f"config.json: rope attention_factor={rp['attention_factor']} differs from the YaRN value "
            f"{ours:.6g} implied by factor/mscale/mscale_all_dim; an explicit attention_factor is not supported",
        )
    return theta, scaling


def _dtype(hf: Mapping[str, Any]) -> str:
    dt = str(_get(hf, "dtype", _get(hf, "torch_dtype", "float32"))).replace("torch.", "")
    # float16 checkpoints are upcast: the model computes in float32 or bfloat16 only
    return "bfloat16" if dt == "bfloat16" else "float32"


def _fp8_block(hf: Mapping[str, Any]) -> tuple[int, int] | None:
    q = hf.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    _require(
        method == "fp8",
        f"config.json: quantization_config.quant_method={method!r} is not supported; "
        f"accepted: 'fp8' (DeepSeek block-wise float8_e4m3fn with weight_scale_inv)",
    )
    fmt = q.get("fmt", "e4m3")
    _require(fmt == "e4m3", f"config.json: quantization_config.fmt={fmt!r} is not supported; accepted: 'e4m3'")
    block = q.get("weight_block_size")
    _require(
        isinstance(block, (list, tuple)) and len(block) == 2 and all(int(b) > 0 for b in block),
        f"config.json: quantization_config.weight_block_size={block!r} must be two positive integers "
        f"(e.g. [128, 128]); per-tensor or per-channel fp8 is not supported",
    )
    return int(block[0]), int(block[1])


def _common(hf: Mapping[str, Any]) -> dict[str, Any]:
    act = _get(hf, "hidden_act", "silu")
    _require(act == "silu", f"config.json: hidden_act={act!r} is not supported; accepted: 'silu'")
    _require(
        not hf.get("attention_bias", False),
        "config.json: attention_bias=true is not supported (the model has no attention biases); accepted: false",
    )
    _require(not hf.get("mlp_bias", False), "config.json: mlp_bias=true is not supported; accepted: false")
    return dict(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=int(hf["num_attention_heads"]),
        intermediate_size=int(hf["intermediate_size"]),
        max_position_embeddings=int(_get(hf, "max_position_embeddings", 4096)),
        rms_norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(_get(hf, "tie_word_embeddings", False)),
        initializer_range=float(_get(hf, "initializer_range", 0.02)),
    )


def _deepseek(hf: Mapping[str, Any], family: str) -> tuple[dict[str, Any], int]:
    freq = _get(hf, "moe_layer_freq", 1)
    _require(
        freq == 1,
        f"config.json: moe_layer_freq={freq} is not supported; accepted: 1 (every layer after "
        f"first_k_dense_replace is MoE)",
    )
    scoring = _get(hf, "scoring_func", "sigmoid" if family == "deepseek_v3" else "softmax")
    method = _get(hf, "topk_method", "noaux_tc" if family == "deepseek_v3" else "greedy")
    n_group, topk_group = int(_get(hf, "n_group", 1)), int(_get(hf, "topk_group", 1))
    norm = bool(_get(hf, "norm_topk_prob", family == "deepseek_v3"))
    if family == "deepseek_v3":
        # transformers' DeepseekV3 router is always sigmoid + bias-corrected group-limited top-k
        _require(
            scoring == "sigmoid",
            f"config.json: deepseek_v3 scoring_func={scoring!r} is not supported; accepted: 'sigmoid'",
        )
        _require(
            method == "noaux_tc",
            f"config.json: deepseek_v3 topk_method={method!r} is not supported; accepted: 'noaux_tc'",
        )
        topk_method = "noaux_tc"
    else:
        _require(
            scoring == "softmax",
            f"config.json: deepseek_v2 scoring_func={scoring!r} is not supported; accepted: 'softmax'",
        )
        accepted = {"greedy": "greedy", "group_limited_greedy": "group_limited"}
        _require(
            method in accepted,
            f"config.json: deepseek_v2 topk_method={method!r} is not supported; accepted: {', '.join(accepted)}",
        )
        topk_method = accepted[method]
        if topk_method == "greedy":
            n_group = topk_group = 1  # unused by greedy routing; keeps validation simple
        if norm:
            # the transformers DeepseekV2 router never renormalises the top-k weights
            log.warning(
                "config.json: deepseek_v2 norm_topk_prob=true is ignored (transformers' DeepseekV2 "
                "router does not renormalise); loading with norm_topk_prob=false"
            )
            norm = False
    shared = int(_get(hf, "n_shared_experts", 0))
    _require(shared > 0, f"config.json: n_shared_experts={shared} is not supported for {family}; accepted: >= 1")
    q_lora = _get(hf, "q_lora_rank", 0)
    fields = dict(
        attention_type="mla",
        q_lora_rank=int(q_lora or 0),
        kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
        qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
        v_head_dim=int(hf["v_head_dim"]),
        # DeepseekV2 always rotates interleaved pairs (complex multiplication)
        rope_interleave=bool(_get(hf, "rope_interleave", True)) if family == "deepseek_v3" else True,
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        num_experts=int(hf["n_routed_experts"] if "n_routed_experts" in hf else hf["num_local_experts"]),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        num_shared_experts=shared,
        first_k_dense=int(_get(hf, "first_k_dense_replace", 0)),
        score_func=scoring,
        topk_method=topk_method,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=float(_get(hf, "routed_scaling_factor", 1.0)),
    )
    mtp = int(_get(hf, "num_nextn_predict_layers", _get(hf, "num_mtp_layers", 0))) if family == "deepseek_v3" else 0
    return fields, mtp


def _qwen3_moe(hf: Mapping[str, Any]) -> dict[str, Any]:
    _require(
        not hf.get("use_sliding_window", False),
        "config.json: use_sliding_window=true is not supported; accepted: false",
    )
    step = int(_get(hf, "decoder_sparse_step", 1))
    _require(step == 1, f"config.json: decoder_sparse_step={step} is not supported; accepted: 1")
    dense = sorted(int(i) for i in _get(hf, "mlp_only_layers", []))
    _require(
        dense == list(range(len(dense))),
        f"config.json: mlp_only_layers={dense} is not supported; dense layers must come first "
        f"(accepted: [], [0], [0, 1], ...)",
    )
    heads = int(hf["num_attention_heads"])
    return dict(
        attention_type="gqa",
        num_kv_heads=int(_get(hf, "num_key_value_heads", heads)),
        head_dim=int(_get(hf, "head_dim", int(hf["hidden_size"]) // heads)),
        qk_norm=True,
        rope_interleave=False,
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        # the hub spells it num_experts; transformers 5 writes its canonical num_local_experts
        num_experts=int(hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        num_shared_experts=0,
        first_k_dense=len(dense),
        score_func="softmax",
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        norm_topk_prob=bool(_get(hf, "norm_topk_prob", False)),
        routed_scaling_factor=1.0,
    )


def model_config_from_hf(hf: Mapping[str, Any], *, dtype: str | None = None) -> tuple[ModelConfig, HFInfo]:
    """config.json contents -> (ModelConfig with num_mtp_layers=0, HFInfo). The caller sets
    num_mtp_layers once it knows how many MTP modules the checkpoint really holds."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES and isinstance(hf.get("text_config"), Mapping):
        hf, model_type = hf["text_config"], hf["text_config"].get("model_type")  # multimodal wrappers
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"config.json: model_type={model_type!r} is not supported; accepted: {', '.join(MODEL_TYPES)}"
        )
    family = MODEL_TYPES[model_type]
    try:
        fields = _common(hf)
        mtp = 0
        if family == "qwen3_moe":
            fields.update(_qwen3_moe(hf))
        else:
            more, mtp = _deepseek(hf, family)
            fields.update(more)
        theta, scaling = _rope(hf)
    except KeyError as e:
        raise ConfigError(f"config.json ({model_type}): required key {e.args[0]!r} is missing") from None
    dt = as_dtype(dtype or _dtype(hf))
    cfg = ModelConfig(
        name=str(_get(hf, "_name_or_path", model_type)) or model_type,
        rope_theta=theta,
        rope_scaling=scaling,
        param_dtype=dt,
        compute_dtype=dt,
        **fields,
    )
    try:
        validate_model(cfg)
    except ConfigError as e:
        raise ConfigError(f"config.json ({model_type}) maps to an invalid model: {e}") from None
    return cfg, HFInfo(family, mtp, _fp8_block(hf), dt)


# --------------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------------


def family_for(cfg: ModelConfig) -> str:
    """The HF model_type that reproduces `cfg` exactly, or a ConfigError saying what differs."""

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ConfigError(f"save_pretrained: {what}")

    need(cfg.num_experts > 0, "dense models (num_experts=0) have no HF MoE equivalent here; accepted: num_experts >= 1")
    if cfg.attention_type == "gqa":
        need(
            cfg.score_func == "softmax" and cfg.topk_method == "greedy",
            f"qwen3_moe routes with softmax + greedy top-k, got score_func={cfg.score_func!r}, "
            f"topk_method={cfg.topk_method!r}",
        )
        need(
            cfg.num_shared_experts == 0,
            f"qwen3_moe has no shared experts, got num_shared_experts={cfg.num_shared_experts}",
        )
        need(
            cfg.routed_scaling_factor == 1.0, f"qwen3_moe has no routed_scaling_factor, got {cfg.routed_scaling_factor}"
        )
        need(cfg.qk_norm and not cfg.rope_interleave, "qwen3_moe needs qk_norm=true and rope_interleave=false")
        need(cfg.num_mtp_layers == 0, "qwen3_moe has no MTP modules; set num_mtp_layers=0")
        return "qwen3_moe"
    need(cfg.num_shared_experts >= 1, "DeepSeek checkpoints need num_shared_experts >= 1")
    if cfg.score_func == "sigmoid":
        need(
            cfg.topk_method in ("noaux_tc", "greedy"),
            f"deepseek_v3 routes with noaux_tc (or greedy as one group), got topk_method={cfg.topk_method!r}",
        )
        return "deepseek_v3"
    need(
        cfg.topk_method in ("greedy", "group_limited"),
        f"deepseek_v2 (softmax routing) supports greedy and group_limited, got topk_method={cfg.topk_method!r}",
    )
    need(not cfg.norm_topk_prob, "transformers' deepseek_v2 router does not renormalise; norm_topk_prob must be false")
    need(cfg.rope_interleave, "deepseek_v2 always uses interleaved rope; rope_interleave must be true")
    need(cfg.num_mtp_layers == 0, "deepseek_v2 has no MTP modules; set num_mtp_layers=0")
    return "deepseek_v2"


def _rope_parameters(cfg: ModelConfig, rs: RopeScalingConfig) -> dict[str, Any]:
    if rs.type != "yarn":
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    out = {
        "rope_type": "yarn",
        "rope_theta": cfg.rope_theta,
        "factor": rs.factor,
        "original_max_position_embeddings": rs.original_max_position_embeddings,
        "beta_fast": rs.beta_fast,
        "beta_slow": rs.beta_slow,
        "truncate": rs.truncate,
    }
    if rs.mscale_all_dim:
        out.update(mscale=rs.mscale, mscale_all_dim=rs.mscale_all_dim)
    return out


def hf_config_from_model(cfg: ModelConfig, dtype: str | None = None) -> dict[str, Any]:
    """ModelConfig -> config.json contents that transformers loads into an equivalent model.

    YaRN fields come from `hf_rope.export_rope`: the same frequencies with a vLLM table covering
    max_position_embeddings (or max_position_embeddings capped where no fields cover it)."""
    from composer_jax.hf.rope import export_rope  # local: numpy + model layers

    family = family_for(cfg)
    rope = export_rope(cfg)
    assert rope is not None  # at the model's own rotary dimension the trained fields always qualify
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "hidden_act": "silu",
        "max_position_embeddings": rope.max_position_embeddings,
        "initializer_range": cfg.initializer_range,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "rope_parameters": _rope_parameters(cfg, rope.scaling),
        "norm_topk_prob": cfg.norm_topk_prob,
        "dtype": dtype or cfg.param_dtype,
        "use_cache": True,
    }
    if family == "qwen3_moe":
        out.update(
            num_key_value_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            num_experts=cfg.num_experts,
            decoder_sparse_step=1,
            mlp_only_layers=list(range(cfg.num_dense_layers)),
            use_sliding_window=False,
        )
        return out
    greedy_v3 = family == "deepseek_v3" and cfg.topk_method == "greedy"
    out.update(
        num_key_value_heads=cfg.num_heads,
        q_lora_rank=cfg.q_lora_rank or None,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        n_routed_experts=cfg.num_experts,
        n_shared_experts=cfg.num_shared_experts,
        first_k_dense_replace=cfg.num_dense_layers,
        routed_scaling_factor=cfg.routed_scaling_factor,
        n_group=1 if greedy_v3 else cfg.n_group,
        topk_group=1 if greedy_v3 else cfg.topk_group,
        moe_layer_freq=1,
        # read by DeepSeek's own (remote) modelling code; transformers keeps them as plain attributes
        scoring_func=cfg.score_func,
        topk_method={
            "noaux_tc": "noaux_tc",
            "greedy": "greedy" if family == "deepseek_v2" else "noaux_tc",
            "group_limited": "group_limited_greedy",
        }[cfg.topk_method],
    )
    if family == "deepseek_v3":
        out.update(rope_interleave=cfg.rope_interleave, num_nextn_predict_layers=cfg.num_mtp_layers)
    return out
