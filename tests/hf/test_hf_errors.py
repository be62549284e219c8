"""Every checkpoint mistake a user can make gives an error naming the value and what is accepted."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

import composer_jax as cj
from composer_jax.checkpoint.validate import CheckpointError
from composer_jax.config import ConfigError
from composer_jax.hf.config import model_config_from_hf

torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

pytestmark = pytest.mark.hf
TINY = Path(__file__).resolve().parents[2] / "configs" / "model" / "tiny.yaml"


def _copy(built, tmp_path, edit_config=None, edit_state=None):
    """A copy of a saved case with config.json and/or the tensors edited."""
    hf_cfg = json.loads((built.path / "config.json").read_text())
    if edit_config:
        edit_config(hf_cfg)
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    if edit_state:
        state = load_file(str(built.path / "model.safetensors"))
        edit_state(state)
        save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    else:
        shutil.copy(built.path / "model.safetensors", tmp_path / "model.safetensors")
    return tmp_path


def test_unknown_model_type_is_named(hf_checkpoint, tmp_path):
    d = _copy(hf_checkpoint("v3_plain"), tmp_path, edit_config=lambda c: c.update(model_type="llama"))
    with pytest.raises(
        ConfigError,
        match=r"model_type='llama' is not supported; accepted: deepseek_v3, kimi_k2, "
        r"deepseek_v2, qwen3_moe",
    ):
        cj.from_pretrained(d)


def test_missing_tensor_names_tensor_and_files(hf_checkpoint, tmp_path):
    d = _copy(
        hf_checkpoint("v3_plain"), tmp_path, edit_state=lambda s: s.pop("model.layers.1.self_attn.kv_b_proj.weight")
    )
    with pytest.raises(CheckpointError) as e:
        cj.from_pretrained(d)
    msg = str(e.value)
    assert "'model.layers.1.self_attn.kv_b_proj.weight'" in msg
    assert "params['moe_layers']['attn']['kv_b']" in msg and "searched: model.safetensors" in msg


def test_missing_experts_name_both_layouts(hf_checkpoint, tmp_path):
    def drop(state):
        for k in [k for k in state if k.startswith("model.layers.1.mlp.experts.")]:
            del state[k]

    d = _copy(hf_checkpoint("v3_plain"), tmp_path, edit_state=drop)
    with pytest.raises(
        CheckpointError,
        match=r"'model.layers.1.mlp.experts.0.down_proj.weight' or "
        r"'model.layers.1.mlp.experts.down_proj'",
    ):
        cj.from_pretrained(d)


def test_wrong_shape_names_tensor_and_both_shapes(hf_checkpoint, tmp_path):
    # config says kv_lora_rank 12 but the tensors were made with 16
    d = _copy(hf_checkpoint("v3_plain"), tmp_path, edit_config=lambda c: c.update(kv_lora_rank=12))
    with pytest.raises(CheckpointError) as e:
        cj.from_pretrained(d)
    msg = str(e.value)
    assert "'model.layers.0.self_attn.kv_a_proj_with_mqa.weight'" in msg
    assert "has shape [24, 32]" in msg and "expected [20, 32]" in msg


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("attention_bias", True, r"attention_bias=true is not supported"),
        ("hidden_act", "gelu", r"hidden_act='gelu' is not supported; accepted: 'silu'"),
        (
            "rope_parameters",
            {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
            r"rope type 'linear' is not supported",
        ),
        ("scoring_func", "softmax", r"deepseek_v3 scoring_func='softmax' is not supported; accepted: 'sigmoid'"),
        ("moe_layer_freq", 2, r"moe_layer_freq=2 is not supported"),
        ("quantization_config", {"quant_method": "gptq"}, r"quant_method='gptq' is not supported"),
        ("n_group", 3, r"n_group=3 must divide model.num_experts=8"),
    ],
)
def test_unsupported_config_values(hf_checkpoint, tmp_path, key, value, match):
    d = _copy(hf_checkpoint("v3_plain"), tmp_path, edit_config=lambda c: c.update({key: value}))
    with pytest.raises(ConfigError, match=match):
        cj.from_pretrained(d)


def test_qwen3_dense_layers_must_come_first():
    hf = dict(
        model_type="qwen3_moe",
        vocab_size=8,
        hidden_size=8,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=8,
        moe_intermediate_size=4,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
    )
    with pytest.raises(ConfigError, match=r"mlp_only_layers=\[1\] is not supported; dense layers must come first"):
        model_config_from_hf(hf)


def test_fp8_without_scales(hf_checkpoint, tmp_path):
    name = "model.layers.0.self_attn.o_proj.weight"

    def to_fp8(state):
        state[name] = state[name].to(torch.float8_e4m3fn)

    d = _copy(
        hf_checkpoint("v3_plain"),
        tmp_path,
        edit_state=to_fp8,
        edit_config=lambda c: c.update(
            quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}
        ),
    )
    with pytest.raises(CheckpointError, match=rf"'{name}_scale_inv' \(for the block scales of FP8 tensor '{name}'\)"):
        cj.from_pretrained(d)


def test_no_config_json(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        cj.from_pretrained(tmp_path)


def test_save_refuses_what_hf_cannot_express(tmp_path):
    cfg = cj.load_config(TINY, num_devices=None).model
    params = jax.eval_shape(lambda: cj.init_params(cfg, jax.random.key(0)))
    bad = dataclasses.replace(cfg, score_func="sigmoid", topk_method="group_limited")
    with pytest.raises(ConfigError, match=r"deepseek_v3 routes with noaux_tc .* got topk_method='group_limited'"):
        cj.save_pretrained(params, bad, tmp_path)
    gqa = dataclasses.replace(
        cfg, attention_type="gqa", score_func="softmax", topk_method="greedy", n_group=1, topk_group=1, num_mtp_layers=0
    )
    with pytest.raises(ConfigError, match=r"qwen3_moe has no shared experts, got num_shared_experts=1"):
        cj.save_pretrained(params, gqa, tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_save_checks_param_shapes(tmp_path):
    cfg = cj.load_config(TINY, num_devices=None).model
    params = jax.tree.map(
        lambda s: np.zeros(s.shape, s.dtype), jax.eval_shape(lambda: cj.init_params(cfg, jax.random.key(0)))
    )
    params["embed"] = np.zeros((10, cfg.hidden_size), np.float32)
    with pytest.raises(CheckpointError, match=r"params\['embed'\] has shape \[10, 64\]; cfg expects \[512, 64\]"):
        cj.save_pretrained(params, cfg, tmp_path)


def test_convert_cli_round_trips(hf_checkpoint, tmp_path, capsys):
    """hf -> hf, hf -> orbax -> hf, and --print-config through `composer-jax convert`."""
    from composer_jax.hf.convert import main

    built = hf_checkpoint("v2_group")
    assert main(["--from-hf", str(built.path), "--print-config"]) == 0
    assert "topk_method: group_limited" in capsys.readouterr().out
    assert main(["--from-hf", str(built.path), "--to-hf", str(tmp_path / "hf"), "--max-shard-size", "30KB"]) == 0
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert main(["--from-hf", str(tmp_path / "hf"), "--to-orbax", str(tmp_path / "orbax")]) == 0
    assert main(["--from-orbax", str(tmp_path / "orbax"), "--to-hf", str(tmp_path / "hf2")]) == 0
    _, a = cj.from_pretrained(built.path)
    _, b = cj.from_pretrained(tmp_path / "hf2")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert main(["--from-hf", str(tmp_path / "nope"), "--to-hf", str(tmp_path / "x")]) == 1
    assert "no config.json" in capsys.readouterr().err
