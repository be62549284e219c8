"""The LoRA adapter export (hf/lora_export.py) against PEFT: transformers loads the exported base,
PEFT applies our `adapter_config.json` + `adapter_model.safetensors`, and its logits equal ours
(the adapted forward, model/lora.py) within 1e-4."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import composer_jax as cj
from composer_jax.config import ConfigError, LoraConfig
from composer_jax.hf.config import family_for
from composer_jax.hf.lora_export import CONFIG_NAME, WEIGHTS_NAME, peft_tensors, save_peft_adapter
from composer_jax.hf.weights import layer_map_of
from composer_jax.model import lora

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.hf
TOL = 1e-4
TINY = Path(__file__).resolve().parents[2] / "configs" / "model" / "tiny.yaml"


def _adapters(cfg, lc, seed=0):
    """Adapters with nonzero B (fresh ones change nothing)."""
    tree = lora.init_adapters(cfg, lc, jax.random.key(seed))
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree.unflatten(treedef, [0.2 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["v3_full", "v3_plain"])
def test_peft_loads_our_adapter_and_logits_match(case, hf_checkpoint, tokens, tmp_path):
    """(slow: 9-20 s, transformers and PEFT building the model; the default suite keeps the layout
    in `test_peft_factors_give_the_merged_delta_in_hf_layout` and the math in
    tests/model/test_lora.py's `test_adapter_math_against_numpy`.) v3_full: query LoRA (q_a/q_b),
    a dense first layer, YaRN; v3_plain: q without LoRA, no
    dense layer, non-interleaved rope. Every attention projection of every layer adapted."""
    from transformers import AutoModelForCausalLM

    built = hf_checkpoint(case)
    cfg, base = cj.from_pretrained(built.path)
    lc = LoraConfig(rank=4, alpha=6.0, targets=("attention",))
    adapters = _adapters(cfg, lc)
    out = save_peft_adapter(adapters, cfg, lc, tmp_path / "adapter", base_model=str(built.path))
    config = json.loads((out / CONFIG_NAME).read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 6.0 and (out / WEIGHTS_NAME).exists()

    ours = jax.jit(lambda b, a, t: cj.forward(lora.join(b, a, lc.scale), t, cfg).logits)(
        base, adapters, jnp.asarray(tokens)
    )
    plain = jax.jit(lambda b, t: cj.forward(b, t, cfg).logits)(base, jnp.asarray(tokens))
    hf_base = AutoModelForCausalLM.from_pretrained(built.path, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(hf_base, str(out)).eval()
    wrapped = [n for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert len(wrapped) == len(config["target_modules"])
    with torch.no_grad():
        ref = model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()
    d = float(np.max(np.abs(np.asarray(ours, np.float64) - ref)))
    print(
        f"[peft] {case}: max|ours - peft| = {d:.2e}, "
        f"the adapters move the logits by {np.abs(np.asarray(plain) - ref).max():.2e}"
    )
    assert float(np.max(np.abs(np.asarray(plain) - ref))) > 10 * TOL  # the adapters matter
    assert d < TOL


def test_peft_factors_give_the_merged_delta_in_hf_layout():
    """For every exported module, lora_B @ lora_A (PEFT's delta of the [out, in] weight) is our
    A B written in the base weight's HF layout (hf/weights.py), heads_in (q_b, kv_b) and heads_out
    (o) included."""
    cfg = cj.load_config(TINY, ["model.num_layers=2", "model.num_mtp_layers=0"], num_devices=8).model
    lc = LoraConfig(rank=3, alpha=3.0, targets=("attention",))
    rng = np.random.default_rng(0)
    abstract = lora.abstract_adapters(cfg, lc)
    adapters = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), abstract)
    tensors, modules = peft_tensors(adapters, cfg)
    assert len(modules) == 2 * 5 and len(tensors) == 2 * len(modules)
    layer_map = layer_map_of(cfg, family_for(cfg), moe=True)
    node = adapters["moe_layers"]["attn"]["lora"]
    for name in ("q_a", "q_b", "kv_a", "kv_b", "o"):
        suffix, layout = layer_map[("attn", name)]
        a, b = np.asarray(node[name]["a"][0]), np.asarray(node[name]["b"][0])
        n_in = 2 if name == "o" else 1
        delta = (a.reshape(-1, 3) @ b.reshape(3, -1)).reshape(a.shape[:n_in] + b.shape[1:])
        pre = "base_model.model.model.layers.1." + suffix.removesuffix(".weight")
        got = tensors[pre + ".lora_B.weight"] @ tensors[pre + ".lora_A.weight"]
        np.testing.assert_allclose(got, layout.to_hf(delta), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("target", ["experts", "mlp"])
def test_mlp_and_expert_adapters_have_no_peft_form(target, tmp_path):
    cfg = cj.load_config(TINY, num_devices=8).model
    lc = dataclasses.replace(LoraConfig(rank=2), targets=("attention", target))
    with pytest.raises(ConfigError, match=f"'{target}'.*merged model"):
        save_peft_adapter(lora.abstract_adapters(cfg, lc), cfg, lc, tmp_path)
