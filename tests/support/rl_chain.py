"""The RL link of issue 39's open-model chains (tests/hf/test_open_model_chain*.py): a run of
configs/rl/tiny_disable_debug.yaml from an SFT checkpoint of an HF-layout model in its own template,
watched on its way (`watch`), and the assertions every family's run shares (`check_rl_run`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from composer_jax.config import config_from_dict, read_yaml
from composer_jax.env.api.protocol import session_tool_names, tool_schemas
from composer_jax.formats import tool_calls
from composer_jax.hf.convert import main as convert_main
from composer_jax.rl.algo import batch as rl_batch
from composer_jax.rl.samplers.base import TokenSampler

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv" / "vllm" / "bin" / "python"
# the vLLM link's sampler: one CPU replica of the run's export, float32 so its log-probabilities can
# be held to the trainer's (the mismatch KL)
VLLM_EXTRA = ["rl.sampler_engine=vllm", "rl.local_samplers=1", "rl.vllm.kv_cache_bytes=256M", "rl.vllm.dtype=float32"]


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


def watch(monkeypatch) -> Seen:
    """Record the run's generations, turns, parses and batches (the functions themselves still run)."""
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


def rl_config(hf: Path, sft: Path, out: Path, seq_len: int, extra: list[str]):
    """configs/rl/tiny_disable_debug.yaml's run (its model from the HF checkpoint `hf`, its tokenizer
    and template) from the SFT run `sft`'s checkpoint: two steps of two groups of two short rollouts
    on the bundled family it was made for, on 8 fake devices with the vocabulary sharded (tensor=2)."""
    overrides = [
        f"model.from=hf:{hf}",
        f"data.tokenizer={hf}",
        "train.steps=2",
        f"train.init_from={sft / 'checkpoints'}",
        f"train.out_dir={out}",
        f"train.seq_len={seq_len}",
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
    data = read_yaml(REPO / "configs/rl/tiny_disable_debug.yaml")
    data.pop("model", None)
    data.pop("base", None)
    return config_from_dict(data, overrides, num_devices=8)


def export(run: Path, hf: Path, out: Path) -> Path:
    """`convert --from-run RUN --to-hf OUT --tokenizer HF`; the checkpoint's tokenizer files come back
    byte for byte."""
    assert convert_main(["--from-run", str(run), "--to-hf", str(out), "--tokenizer", str(hf)]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (hf / name).exists():
            assert (out / name).read_bytes() == (hf / name).read_bytes(), name
    return out


def hf_prompt(hf_tok, messages: list[dict], tools: list[dict]) -> list[int]:
    """transformers' rendering of the agent's prompt (the oracle)."""
    want = hf_tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return list(want["input_ids"] if hasattr(want, "keys") else want)


def runs_in_transformers(out: Path, ids: list[int]) -> None:
    """transformers loads the export and its logits on `ids` are finite, one row per embedding row."""
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids[:48]])).logits[0].numpy()
    assert np.all(np.isfinite(logits)) and logits.shape == (min(48, len(ids)), vocab)


def logits_diff(out: Path, ids: list[int]) -> float:
    """max |our logits - transformers'| over `ids` for the export `out` (both float32, one row per
    embedding row)."""
    import jax.numpy as jnp

    import composer_jax as cj

    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    batch = np.asarray([ids], np.int32)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.as_tensor(batch, dtype=torch.long)).logits.numpy()
    cfg, params = cj.from_pretrained(out)
    ours = np.asarray(cj.forward(params, jnp.asarray(batch), cfg).logits, np.float64)
    assert theirs.shape == ours.shape == (1, len(ids), vocab)
    return float(np.max(np.abs(ours - theirs)))


def _tensors(export_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.torch import load_file

    out: dict[str, np.ndarray] = {}
    for f in sorted(export_dir.glob("*.safetensors")):
        out.update({k: v.float().numpy() for k, v in load_file(f).items()})
    return out


def check_rl_run(hf: Path, sft: Path, syntax: str, seen: Seen, summary: dict, run: Path, tmp_path: Path) -> None:
    """The assertions every family's and every sampler's RL run shares: two finite steps from the SFT
    checkpoint; every prompt is transformers' rendering of its messages with the session's tools;
    every sampled turn was read in the family's `syntax` and its calls are OpenAI-shaped; the batches
    hold exactly the sampled tokens and log-probabilities, masked exactly where they were sampled;
    the weights moved where an advantage is not zero; the RL export loads and runs in transformers."""
    assert summary["final_step"] == 2 and not summary.get("lost_groups")
    assert summary["init"]["kind"] == "run", summary["init"]  # the SFT checkpoint, not a fresh model
    for n, values in summary["steps"].items():
        bad = {k: v for k, v in values.items() if isinstance(v, float) and not np.isfinite(v)}
        assert not bad, (n, bad)
    out = export(run, hf, tmp_path / "rl_export")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)  # a tiktoken export's code
    tools = tool_schemas(session_tool_names(False))
    assert seen.begun
    for messages, given, ids in seen.begun:
        assert given == tools  # the session's tools, as the template's `tools`
        assert ids == hf_prompt(hf_tok, messages, tools)
    assert seen.turns and seen.syntaxes.count(syntax) == len(seen.syntaxes) >= len(seen.turns), set(seen.syntaxes)
    assert all(c["type"] == "function" and isinstance(json.loads(c["function"]["arguments"]), dict) for c in seen.calls)
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
    before, after = _tensors(export(sft, hf, tmp_path / "sft_export")), _tensors(out)
    assert before.keys() == after.keys()
    assert all(np.all(np.isfinite(v)) for v in after.values())
    moved = any(not np.array_equal(before[k], after[k]) for k in before)
    if any(np.any(b["advantages"] != 0) for b in seen.batches):
        assert moved
    else:  # every group's rollouts tied (a random model solves nothing, each turn runs to its budget)
        assert all(v["grad_norm"] == 0.0 for v in summary["steps"].values()) and not moved
    runs_in_transformers(out, seen.begun[0][2])


def check_vllm_run(said: list[str], summary: dict, run: Path) -> None:
    """What the vLLM link adds: a replica sampled over its token-in, token-out route, and its
    log-probabilities agree with the trainer's (the mismatch KL)."""
    assert any("vLLM replica" in line for line in said), said
    for n, values in summary["steps"].items():
        assert abs(values["mismatch_kl_k1"]) < 1e-2 and 0 <= values["mismatch_kl_k3"] < 1e-2, (n, values)
    assert (run / "samplers" / "vllm-0.log").read_text().count("/inference/v1/generate") >= 1
