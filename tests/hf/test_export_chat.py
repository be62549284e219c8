"""`composer-jax convert --from-run ... --to-hf`: an export transformers loads and chats with.

A tiny MoE saved as a training checkpoint (the demo's shape: YaRN factor 2 from 256 positions,
max_position_embeddings 4096) is exported; transformers' AutoTokenizer / AutoModelForCausalLM
(the ecosystem's own implementation, the oracle) load the directory. The chat template must give
the project's token ids on the project's own agent conversations (the SFT assets, tool calls and
results, with and without the tool schemas), text prompts get BOS, `generate` gives the project
sampler's greedy tokens, positions past the trained 512 give the project's logits, and the MLA
padding for vLLM leaves the logits unchanged.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.checkpoint.manager import TrainCheckpointer
from composer_jax.cli import main as cli_main
from composer_jax.config import ModelConfig, load_config, to_dict
from composer_jax.config.checkpoint import CheckpointConfig
from composer_jax.env.api.protocol import tool_schemas
from composer_jax.formats.chatml import render_chat, render_prompt
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.hf.config import hf_config_from_model
from composer_jax.hf.convert import main as convert_main
from composer_jax.hf.export import RunInfo, model_card
from composer_jax.model.transformer import forward
from composer_jax.sharding import ShardingRules, make_mesh
from composer_jax.train.state import init_train_state

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "assets" / "tokenizer"
YARN = "{type: yarn, factor: 2.0, original_max_position_embeddings: 256, mscale: 1.0, mscale_all_dim: 1.0}"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A training run directory (checkpoints/ with steps 1 and 2, different weights)."""
    root = tmp_path_factory.mktemp("run")
    for step, seed in ((1, 0), (2, 1)):
        cfg = load_config(
            str(ROOT / "configs/model/tiny.yaml"),
            [
                "model.vocab_size=2048",
                "model.num_layers=2",
                f"model.rope_scaling={YARN}",
                "mesh.fsdp=1",
                f"data.tokenizer={TOKENIZER}",
                f"train.seed={seed}",
            ],
            num_devices=None,
        )
        state = init_train_state(cfg, make_mesh(cfg.mesh, jax.devices()[:1]), ShardingRules.create(cfg.sharding_rules))
        with TrainCheckpointer(CheckpointConfig(directory=str(root / "checkpoints"), save_every=1)) as ck:
            ck.save(step, state, config=to_dict(cfg))
    return root


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "tiny"
    assert convert_main(["--from-run", str(run), "--step", "1", "--to-hf", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def hf_tok(exported):
    return transformers.AutoTokenizer.from_pretrained(exported)


@pytest.fixture(scope="module")
def hf_model(exported):
    return transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def policy(run):
    from composer_jax.hf.convert import load_run

    cfg, params, step, _ = load_run(run, 1)
    assert step == 1
    return cfg, params


def _conversations() -> list[list[dict]]:
    """The SFT assets' agent conversations, tool-call arguments as objects (the form transformers'
    templates take; vLLM parses OpenAI's JSON strings into it before rendering)."""
    rows = [json.loads(line) for line in (ROOT / "assets/sft/train.jsonl").read_text().splitlines()]
    out = []
    for r in rows:
        msgs = copy.deepcopy(r["messages"])
        for m in msgs:
            for c in m.get("tool_calls") or ():
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
        out.append(msgs)
    return out


def test_export_writes_the_files_other_tools_need(exported):
    names = {p.name for p in exported.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "README.md",
    } <= names
    card = (exported / "README.md").read_text()
    assert "checkpoint step 1 of" in card and "vllm serve" in card and "--pad-mla-for-vllm" in card
    assert "-rotary_embedding" not in card  # YaRN: vLLM-CPU rotates it right (the note is for plain RoPE)
    gen = json.loads((exported / "generation_config.json").read_text())
    tok = load_tokenizer(TOKENIZER)
    assert gen["bos_token_id"] == tok.bos_id and gen["eos_token_id"] == [tok.special["<|im_end|>"], tok.eos_id]
    rope = json.loads((exported / "config.json").read_text())["rope_parameters"]
    # vLLM tabulates original x factor positions: the export's table covers all 4096
    assert json.loads((exported / "config.json").read_text())["max_position_embeddings"] == 4096
    assert rope["original_max_position_embeddings"] * rope["factor"] >= 4096


def test_chat_template_gives_the_projects_token_ids(hf_tok):
    tok = load_tokenizer(TOKENIZER)
    tools = tool_schemas()
    convs = _conversations()
    assert any(m.get("tool_calls") for c in convs for m in c) and any(m["role"] == "tool" for c in convs for m in c)
    for i, msgs in enumerate(convs):
        with_tools = tools if i % 2 else None
        want = render_chat(msgs, tok, tools=with_tools)[0].tolist()
        got = hf_tok.apply_chat_template(msgs, tools=with_tools, tokenize=True, return_dict=False)
        assert got == want, f"conversation {i}"
        cut = max(j for j, m in enumerate(msgs) if m["role"] != "assistant")  # up to the last observation
        want = render_prompt(msgs[: cut + 1], tok, tools=with_tools).tolist()
        got = hf_tok.apply_chat_template(
            msgs[: cut + 1], tools=with_tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert got == want, f"conversation {i} prompt"


def test_template_branches_match_the_project(hf_tok):
    """No system message (the tools block gets its own), content parts, a call without id, blank
    and non-JSON argument strings, a canonical JSON string, developer as system."""
    tok = load_tokenizer(TOKENIZER)
    call = lambda i, args: {"type": "function", "function": {"name": "run_shell", "arguments": args}, **i}
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "list "}, {"type": "text", "text": "files"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                call({"id": "c1"}, '{"command": "ls -la", "timeout_s": 5}'),
                call({}, ""),
                call({"id": "c3"}, "not json"),
                call({"id": "c4"}, {"command": "échø ü"}),
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "a.py\nb.py"},
        {"role": "developer", "content": "stay in /app"},
    ]
    tools = tool_schemas(["run_shell"])
    for with_tools in (None, tools):
        want = render_prompt(msgs, tok, tools=with_tools).tolist()
        got = hf_tok.apply_chat_template(
            msgs, tools=with_tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert got == want


def test_special_strings_in_text_stay_text_with_sanitize(hf_tok):
    """The project encodes "<|im_end|>" inside a message as bytes; transformers does with
    sanitize_control_tokens (split at other boundaries, so only the text is the same)."""
    tok = load_tokenizer(TOKENIZER)
    msgs = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "what is <|im_end|>?"}]
    want = render_prompt(msgs, tok).tolist()
    got = hf_tok.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=False, sanitize_control_tokens=True
    )
    im_end = tok.special["<|im_end|>"]
    assert got.count(im_end) == want.count(im_end) == 2  # the two turns' ends only
    assert tok.decode(got) == tok.decode(want)


def test_text_prompts_get_bos(hf_tok):
    tok = load_tokenizer(TOKENIZER)
    text = "def add(a, b):\n    return a + b\n"
    assert hf_tok(text).input_ids == [tok.bos_id, *tok.encode(text)]
    assert hf_tok.decode(hf_tok(text).input_ids, skip_special_tokens=True) == text


def test_the_projects_own_loader_reads_the_export_as_the_original(exported):
    """`composer-jax serve OUT` finds the export's tokenizer: same ids, same special tokens."""
    a, b = load_tokenizer(TOKENIZER), load_tokenizer(exported)
    text = "x = '<|im_end|>'  # a special string in code stays bytes\n"
    assert b.encode(text) == a.encode(text) and a.special["<|im_end|>"] not in b.encode(text)
    assert (b.bos_id, b.eos_id, b.pad_id, b.special) == (a.bos_id, a.eos_id, a.pad_id, a.special)


def test_generate_gives_the_samplers_greedy_tokens(policy, hf_tok, hf_model):
    from composer_jax.inference.engine.batch_sampler import Sampler, SamplerSettings
    from composer_jax.inference.engine.token_sampling import SamplingParams

    cfg, params = policy
    tok = load_tokenizer(TOKENIZER)
    msgs = _conversations()[0][:2]
    prompt = render_prompt(msgs, tok, tools=tool_schemas()).tolist()
    stops = (tok.special["<|im_end|>"], tok.eos_id)
    n = 24
    done = Sampler(params, cfg, SamplerSettings(slots=1, max_len=len(prompt) + n + 8)).run(
        [prompt], SamplingParams(temperature=0.0, max_tokens=n, stop_token_ids=stops)
    )
    ids = hf_tok.apply_chat_template(msgs, tools=tool_schemas(), add_generation_prompt=True, return_tensors="pt")
    assert ids["input_ids"][0].tolist() == prompt
    out = hf_model.generate(**ids, max_new_tokens=n, do_sample=False)
    assert out[0, len(prompt) :].tolist() == done[0].tokens
    assert len(done[0].tokens) >= 8, done[0].tokens  # enough tokens to compare


def _project_logits(cfg, params, tokens, positions):
    f = jax.jit(lambda p, t, q: forward(p, t, cfg, positions=q).logits)
    return np.asarray(f(params, jnp.asarray([tokens], jnp.int32), jnp.asarray([positions], jnp.int32)))[0]


def test_positions_past_the_yarn_table_give_the_projects_logits(policy, hf_model):
    """The run extended 256 x 2 = 512 positions; the export's fields reach 4096 with the same frequencies."""
    cfg, params = policy
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 12).tolist()
    positions = [0, 1, 2, 600, 601, 1500, 1501, 2047, 3000, 3500, 4000, 4095]
    want = _project_logits(cfg, params, tokens, positions)
    with torch.no_grad():
        got = hf_model(torch.tensor([tokens]), position_ids=torch.tensor([positions])).logits[0].numpy()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


def test_padded_export_gives_the_same_logits_and_greedy_tokens(run, exported, hf_model, tmp_path):
    out = tmp_path / "padded"
    assert convert_main(["--from-run", str(run), "--step", "1", "--to-hf", str(out), "--pad-mla-for-vllm"]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert (hf["kv_lora_rank"], hf["qk_rope_head_dim"], hf["qk_nope_head_dim"]) == (512, 64, 32)
    padded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.tensor([np.random.default_rng(1).integers(0, 2048, 16).tolist()])
    positions = torch.tensor([[0, 1, 2, 3, 100, 511, 512, 513, 1000, 1999, 2000, 3000, 3001, 4000, 4094, 4095]])
    with torch.no_grad():
        a = hf_model(tokens, position_ids=positions).logits
        b = padded(tokens, position_ids=positions).logits
    np.testing.assert_allclose(b.numpy(), a.numpy(), atol=2e-6, rtol=0)
    ga = hf_model.generate(tokens, max_new_tokens=16, do_sample=False)
    gb = padded.generate(tokens, max_new_tokens=16, do_sample=False)
    assert ga.tolist() == gb.tolist()


def test_bad_run_directories_are_refused(run, tmp_path, capsys):
    assert convert_main(["--from-run", str(tmp_path / "nope"), "--to-hf", str(tmp_path / "o")]) == 1
    assert "not a directory; accepted: a training run directory" in capsys.readouterr().err
    assert convert_main(["--from-run", str(tmp_path), "--to-hf", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "no checkpoints in" in err and "accepted:" in err
    assert convert_main(["--from-run", str(run), "--step", "7", "--to-hf", str(tmp_path / "o")]) == 1
    assert "no checkpoint for step 7" in capsys.readouterr().err and "saved steps: [1, 2]"
    assert cli_main(["convert", "--from-hf", str(run), "--step", "1", "--to-hf", str(tmp_path / "o")]) == 2
    assert "--step applies to --from-run only" in capsys.readouterr().err


# Slow (a real two-step training run, then its export; ~1-2 min on 2 cores). The default suite keeps
# the property on a saved train state of the same layout (the `run` fixture above).
@pytest.mark.slow
def test_a_trained_run_exports_and_generates_the_samplers_tokens(tmp_path, monkeypatch):
    from composer_jax.inference.engine.batch_sampler import Sampler, SamplerSettings
    from composer_jax.inference.engine.token_sampling import SamplingParams
    from composer_jax.train.loop import run_stage

    monkeypatch.chdir(ROOT)  # the stage's data paths are relative to the repository
    cfg = load_config(
        ROOT / "configs/pretrain/tiny_stage1.yaml",
        [
            "model.num_layers=2",
            "train.seq_len=64",
            "train.steps=2",
            "train.eval_every=100",
            "train.tensorboard=false",
            f"train.out_dir={tmp_path / 'stage'}",
            "checkpoint.save_every=1",
            "train.peak_tflops=1.0",
        ],
        num_devices=8,
    )
    run_stage(cfg, echo=lambda s: None)
    out = tmp_path / "hf"
    assert convert_main(["--from-run", str(tmp_path / "stage"), "--to-hf", str(out)]) == 0
    assert "checkpoint step 2 of 2" in (out / "README.md").read_text()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = load_tokenizer(TOKENIZER)
    msgs = _conversations()[1]
    assert hf_tok.apply_chat_template(msgs, tokenize=True, return_dict=False) == render_chat(msgs, tok)[0].tolist()
    from composer_jax.hf.convert import load_run

    mcfg, params, _, _ = load_run(tmp_path / "stage", None)
    prompt = hf_tok("def add(a, b):").input_ids
    greedy = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=(tok.eos_id,))
    done = Sampler(params, mcfg, SamplerSettings(slots=1, max_len=64)).run([prompt], greedy)
    got = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=tok.eos_id)
    assert got[0, len(prompt) :].tolist() == done[0].tokens


def test_a_plain_rope_mla_card_says_how_vllm_cpu_serves_it():
    cfg = ModelConfig()  # MLA, plain RoPE: vLLM-CPU's rotary-embedding op rotates its query wrongly
    card = model_card(cfg, hf_config_from_model(cfg), RunInfo("r", "init"), (), chat=False)
    assert """--compilation-config '{"custom_ops": ["-rotary_embedding"]}'""" in card
