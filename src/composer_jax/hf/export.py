"""A complete Hugging Face export: weights and config.json (`hf.save_pretrained`), the tokenizer
files (`hf_tokenizer.py`), and a model card, optionally with MLA padded for vLLM (`hf_pad.py`).

    export_hf(params, cfg, "out", tok=tok, source=RunInfo(...), pad_mla_for_vllm=True)

This is what `composer-jax convert --to-hf` writes; the directory loads with transformers'
AutoModelForCausalLM / AutoTokenizer and vLLM (docs/hf_interop.md, "Exports").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from composer_jax.config import ModelConfig
from composer_jax.formats.tokenizer import Tokenizer
from composer_jax.hf.config import hf_config_from_model
from composer_jax.hf.mla_pad import pad_mla
from composer_jax.hf.rope import export_rope
from composer_jax.hf.tokenizer_files import OWN_COPY_NOTE, write_tokenizer_files
from composer_jax.hf.weights import save_pretrained

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """Where the weights came from, for the model card: the source path and kind, the training
    step, and the run's saved config (empty when the source is not a training checkpoint)."""

    path: str
    kind: str
    step: int | None = None
    run_config: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Exported:
    out: Path
    cfg: ModelConfig  # as exported (padded when asked)
    notes: tuple[str, ...]


def _training_lines(info: RunInfo) -> list[str]:
    run = info.run_config or {}
    train, data = run.get("train") or {}, run.get("data") or {}
    if not train:
        return [f"Converted from a {info.kind} checkpoint at `{info.path}` (no training run recorded)."]
    opt = train.get("optimizer") or {}
    lines = [
        f"Trained with composer_jax: stage `{train.get('stage')}`, checkpoint step {info.step} of "
        f"{train.get('steps')} (`{info.path}`).",
        f"- sequence length {train.get('seq_len')}, batch {train.get('batch_size')} sequences per step, "
        f"optimiser {opt.get('name', 'adamw')} lr {opt.get('lr')}",
    ]
    if train.get("init_from"):
        lines.append(f"- initialised from `{train['init_from']}`")
    sources = data.get("sources") or data.get("paths") or data.get("path")
    if sources:
        lines.append(f"- data: `{json.dumps(sources, ensure_ascii=False)[:300]}`")
    return lines


def model_card(
    cfg: ModelConfig, hf_cfg: dict[str, Any], info: RunInfo, notes: tuple[str, ...], chat: bool, own: bool = False
) -> str:
    """README.md: what the model is, its config, how it was trained, how to load it. `own`: the
    checkpoint's own tokenizer files were copied (its template, not the project's chat format)."""
    params = ", ".join(
        f"{k}={hf_cfg[k]}"
        for k in (
            "model_type",
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "n_routed_experts",
            "num_experts",
            "num_experts_per_tok",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "max_position_embeddings",
        )
        if k in hf_cfg
    )
    chat_lines = (
        [
            "The tokenizer's `chat_template` renders composer_jax's chat format (`composer-chatml-v1`, "
            "`formats/chatml.py`) token for token, tools included: pass tool-call `arguments` as objects (vLLM "
            "parses the OpenAI strings itself). Assistant turns end with `<|im_end|>`; tool calls are "
            '`<|tool_call|>{"id": ..., "name": ..., "arguments": {...}}` inside the turn.'
        ]
        if chat
        else ["No chat template: this tokenizer lacks the project's chat tokens (completions only)."]
    )
    if own:
        chat_lines = [
            "The tokenizer files and chat template are the source checkpoint's own, copied unchanged (see the "
            "notes): the chat format and tool-call syntax are that model family's."
        ]
    remote = any(n.startswith(OWN_COPY_NOTE) and re.search(r"tokenization_\w+\.py", n) for n in notes)
    tok_args = '"DIR", trust_remote_code=True' if remote else '"DIR"'
    vllm_args = " --max-model-len " + str(hf_cfg["max_position_embeddings"])
    lines = [
        "---",
        "library_name: transformers",
        "tags: [composer_jax, moe]",
        "---",
        f"# {cfg.name}",
        "",
        f"A {hf_cfg['architectures'][0]} mixture-of-experts decoder exported by `composer-jax convert` "
        f"({cfg.param_dtype} weights).",
        "",
        f"Config: {params}.",
        "",
        "## Training",
        "",
        *_training_lines(info),
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f"tok = AutoTokenizer.from_pretrained({tok_args})",
        'model = AutoModelForCausalLM.from_pretrained("DIR")',
        'ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,',
        '                              return_tensors="pt", return_dict=True)',
        "out = model.generate(**ids, max_new_tokens=64, do_sample=False)",
        "```",
        "",
        "```",
        f"vllm serve DIR{vllm_args}"
        + (
            ""
            if hf_cfg.get("kv_lora_rank") in (None, 512)
            else "   # MLA needs 512 + 64: export with --pad-mla-for-vllm"
        ),
        "```",
        "",
        *(
            [
                'On vLLM\'s CPU build add `--compilation-config \'{"custom_ops": ["-rotary_embedding"]}\'`: its '
                "rotary-embedding op rotates this MLA model's query wrongly (plain RoPE; composer_jax "
                "docs/inference.md).",
                "",
            ]
            if cfg.attention_type == "mla" and cfg.rope_scaling.type == "none"
            else []
        ),
        *(
            []
            if own
            else [
                "Text prompts get `<|bos|>` from the tokenizer's post-processor, as composer_jax's own sampler "
                "prepends it."
            ]
        ),
        *chat_lines,
    ]
    if notes:
        lines += ["", "## Notes", "", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def export_hf(
    params: dict,
    cfg: ModelConfig,
    out_dir: str | os.PathLike,
    *,
    tok: Tokenizer | None,
    source: RunInfo,
    tokenizer_source: Path | None = None,
    pad_mla_for_vllm: bool = False,
    dtype: str | None = None,
    max_shard_size: int | str = "5GB",
) -> Exported:
    """Write the HF directory (module docstring). tok None: weights and card only, noted."""
    notes: list[str] = []
    if pad_mla_for_vllm:
        old = cfg
        cfg, params = pad_mla(cfg, params)
        if cfg is not old:
            notes.append(
                f"MLA padded for vLLM (exact): kv_lora_rank {old.kv_lora_rank} -> {cfg.kv_lora_rank}, "
                f"qk_rope_head_dim {old.qk_rope_head_dim} -> {cfg.qk_rope_head_dim}, qk_nope_head_dim "
                f"{old.qk_nope_head_dim} -> {cfg.qk_nope_head_dim} (composer_jax/hf/mla_pad.py)"
            )
    if cfg.attention_type == "mla" and cfg.rms_norm_eps != 1e-6:
        notes.append(
            f"vLLM's DeepSeek builds the latent RMSNorms with rms_norm_eps={cfg.rms_norm_eps}; composer_jax "
            "and transformers use 1e-6 there, so vLLM's logits differ slightly"
        )
    if cfg.num_mtp_layers:
        notes.append(
            f"{cfg.num_mtp_layers} MTP module(s) at model.layers.{cfg.num_layers}+ (DeepSeek's layout): "
            "transformers lists their tensors as unexpected and ignores them (as for DeepSeek-V3's own release)"
        )
    rope = export_rope(cfg)
    if rope is not None and rope.note:
        notes.append(rope.note)
    if cfg.rope_scaling.type == "yarn" and not cfg.rope_scaling.truncate:
        notes.append("YaRN truncate=false: transformers honours it, vLLM's DeepSeek YaRN always truncates")
    out = save_pretrained(params, cfg, out_dir, max_shard_size=max_shard_size, dtype=dtype)
    hf_cfg = hf_config_from_model(cfg, dtype)
    chat = own = False
    if tok is None:
        notes.append("no tokenizer was given (--tokenizer): tokenizer files not written")
    else:
        note = write_tokenizer_files(tok, out, hf_cfg["max_position_embeddings"], tokenizer_source)
        chat = note is None
        own = note is not None and note.startswith(OWN_COPY_NOTE)
        notes += [note] if note else []
    (out / "README.md").write_text(model_card(cfg, hf_cfg, source, tuple(notes), chat, own))
    for n in notes:
        log.info("export %s: %s", out, n)
    return Exported(out, cfg, tuple(notes))
