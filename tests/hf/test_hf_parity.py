"""Logit parity with Hugging Face transformers (torch, float32, eval) for every converter option.

Reference: transformers' own DeepseekV3 / DeepseekV2 / Qwen3Moe implementations on the same weights.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.hf_cases import CASES, VOCAB, build_model  # tests/support/hf_cases.py

import composer_jax as cj
from composer_jax.config import MeshConfig
from composer_jax.hf import weights as hf_ckpt
from composer_jax.hf.rope import same_frequencies
from composer_jax.model.params import param_shardings
from composer_jax.sharding import MeshRules, ShardingRules

pytest.importorskip("torch")
import torch  # noqa: E402  (after the importorskip)

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402  (after the importorskip)

pytestmark = pytest.mark.hf
TOL = 1e-4


@functools.cache
def _forward(cfg):
    return jax.jit(lambda p, t, s: cj.forward(p, t, cfg, segment_ids=s))


def run(cfg, params, tokens, segment_ids=None):
    tokens = jnp.asarray(tokens, jnp.int32)
    seg = jnp.ones(tokens.shape, jnp.int32) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    return _forward(cfg)(params, tokens, seg)


@pytest.fixture(scope="module")
def loaded(hf_checkpoint):
    @functools.cache
    def get(name):
        return cj.from_pretrained(hf_checkpoint(name).path)

    return get


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, hf_checkpoint, loaded, tokens):
    built = hf_checkpoint(case)
    cfg, params = loaded(case)
    ref = built.logits(tokens)
    out = run(cfg, params, tokens)
    d = max_diff(out.logits, ref)
    print(f"[parity] {case}: batch {tokens.shape} max|diff| = {d:.2e} (max|logit| {np.abs(ref).max():.2f})")
    assert d < TOL


@pytest.mark.parametrize("case", list(CASES))
def test_packed_row_matches_separate_sequences(case, hf_checkpoint, loaded):
    """One packed row of three segments (plus padding) == transformers on each segment alone."""
    built = hf_checkpoint(case)
    cfg, params = loaded(case)
    rng = np.random.RandomState(1)
    lengths = [5, 7, 3]
    segs = [rng.randint(0, VOCAB, size=n) for n in lengths]
    row = np.concatenate(segs + [np.zeros(1, np.int64)])[None]
    seg_ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(1, np.int64)])[None]
    out = np.asarray(run(cfg, params, row, seg_ids).logits)[0]
    ref = np.concatenate([built.logits(s[None])[0] for s in segs])
    d = max_diff(out[: sum(lengths)], ref)
    print(f"[parity] {case}: packed {lengths} max|diff| = {d:.2e}")
    assert d < TOL


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_through_transformers(case, hf_checkpoint, loaded, tokens, tmp_path):
    """ours -> save_pretrained -> transformers.from_pretrained == the original transformers model."""
    built = hf_checkpoint(case)
    cfg, params = loaded(case)
    cj.save_pretrained(params, cfg, tmp_path)
    cls = type(built.model)
    again = cls.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        got = again(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    assert max_diff(got, built.logits(tokens)) < 1e-5
    # and the weights themselves came back bit for bit
    orig = built.model.state_dict()
    for k, v in again.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), orig[k].numpy(), err_msg=k)
    cfg2, _ = cj.from_pretrained(tmp_path)
    # YaRN fields may be rewritten so vLLM's table covers max_position_embeddings (hf_rope.py):
    # the same frequencies, checked by the project's own computation
    dim = cfg.qk_rope_head_dim if cfg.attention_type == "mla" else cfg.head_dim
    assert same_frequencies(dim, cfg.rope_theta, cfg.rope_scaling, dim, cfg2.rope_scaling)
    assert dataclasses.replace(cfg2, rope_scaling=cfg.rope_scaling) == cfg


def test_router_bias_changes_selection(hf_checkpoint, tokens):
    """The v3 cases' random e_score_correction_bias really moves the routing (so parity tests the
    bias-for-selection-only rule): zeroing it changes transformers' logits well beyond TOL."""
    built = hf_checkpoint("v3_full")
    model = build_model("v3_full")
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
        zero = model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    assert max_diff(zero, built.logits(tokens)) > 100 * TOL


@pytest.mark.parametrize("case", ["v3_full", "qwen3_norm"])
def test_fused_expert_tensors(case, hf_checkpoint, tokens, tmp_path):
    """A checkpoint holding transformers' in-memory fused experts (gate_up_proj [E, 2f, d],
    down_proj [E, d, f]) loads to the same model."""
    built = hf_checkpoint(case)
    state = {k: v.contiguous() for k, v in built.model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(built.path / "config.json", tmp_path / "config.json")
    cfg, params = cj.from_pretrained(tmp_path)
    d = max_diff(run(cfg, params, tokens).logits, built.logits(tokens))
    print(f"[parity] {case}: fused experts max|diff| = {d:.2e}")
    assert d < TOL


def _quantise_fp8(w: torch.Tensor, block: tuple[int, int]):
    """DeepSeek block FP8: per (bo x bi) block, scale_inv = amax / 448, w_fp8 = w / scale_inv."""
    bo, bi = block
    r, c = w.shape
    nr, nc = -(-r // bo), -(-c // bi)
    padded = torch.zeros(nr * bo, nc * bi)
    padded[:r, :c] = w
    blocks = padded.view(nr, bo, nc, bi)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).view(nr * bo, nc * bi)[:r, :c].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.float().contiguous()


def _dequantise(q, scale, block):
    bo, bi = block
    r, c = q.shape
    full = scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:r, :c]
    return q.float() * full


def test_fp8_block_quantised_checkpoint(hf_checkpoint, tokens, tmp_path):
    """Hand-made DeepSeek FP8 checkpoint (16x16 blocks, partial edge blocks on 24-wide matrices):
    dequantised weights equal torch's dequantisation, and the logits equal transformers run on those
    dequantised weights."""
    built = hf_checkpoint("v3_full")
    block = (16, 16)
    state = load_file(str(built.path / "model.safetensors"))
    quant, deq = {}, {}
    for k, v in state.items():
        linear = k.endswith("_proj.weight") or k.endswith("proj_with_mqa.weight")
        if linear and v.ndim == 2:
            q, s = _quantise_fp8(v, block)
            quant[k], quant[k + "_scale_inv"] = q, s
            deq[k] = _dequantise(q, s, block)
        else:
            quant[k] = v
            deq[k] = v
    save_file(quant, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf_cfg = json.loads((built.path / "config.json").read_text())
    hf_cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    cfg, params = cj.from_pretrained(tmp_path)
    # weights: ours [in, out] vs dequantised HF [out, in]
    kv_a = deq["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].numpy()  # [24, 32]: partial row block
    np.testing.assert_allclose(np.asarray(params["moe_layers"]["attn"]["kv_a"][0]), kv_a.T, rtol=0, atol=0)
    up = deq["model.layers.2.mlp.experts.5.up_proj.weight"].numpy()
    np.testing.assert_allclose(np.asarray(params["moe_layers"]["moe"]["up"][1, 5]), up.T, rtol=0, atol=0)
    # logits: transformers on the dequantised weights
    model = build_model("v3_full")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                pre = name.rsplit("experts.", 1)[0] + "experts."
                e = p.shape[0]
                if name.endswith("gate_up_proj"):
                    p.copy_(
                        torch.stack(
                            [
                                torch.cat([deq[f"{pre}{i}.gate_proj.weight"], deq[f"{pre}{i}.up_proj.weight"]])
                                for i in range(e)
                            ]
                        )
                    )
                else:
                    p.copy_(torch.stack([deq[f"{pre}{i}.down_proj.weight"] for i in range(e)]))
            else:
                p.copy_(deq[name])
        ref = model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    out = run(cfg, params, tokens).logits
    d = max_diff(out, ref)
    ref_float = built.logits(tokens)
    rel_float = float(np.mean(np.abs(np.asarray(out) - ref_float)) / np.mean(np.abs(ref_float)))
    print(f"[parity] v3_full fp8: vs dequantised transformers {d:.2e}; mean rel. diff vs float model {rel_float:.3f}")
    assert d < TOL
    # FP8 rounding (and the routing flips it causes), not a wiring error: a wrong scale layout is O(1)
    assert rel_float < 0.15


def test_sharded_load_matches_unsharded(hf_checkpoint, loaded, tokens, tmp_path):
    built = hf_checkpoint("v3_full")
    mesh = cj.make_mesh(MeshConfig(data=1, fsdp=2, expert=2, context=1, tensor=2))
    rules = ShardingRules.create()
    cfg, params = cj.from_pretrained(built.path, mesh, rules=rules)
    want = param_shardings(cfg, mesh, rules)
    for (path, arr), sh in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(want)):
        assert arr.sharding.is_equivalent_to(sh, arr.ndim), (path, arr.sharding, sh)
    assert params["moe_layers"]["moe"]["gate"].sharding.spec[1] == "expert"
    # values equal the unsharded load, and so do the logits of a sharded forward
    cfg0, params0 = loaded("v3_full")
    assert cfg0 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params0)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    batch = np.concatenate([tokens, tokens[::-1]])  # 4 rows: split over fsdp x expert
    fwd = jax.jit(lambda p, t: cj.forward(p, t, cfg, sharding=MeshRules(mesh, rules)).logits)
    d = max_diff(fwd(params, jnp.asarray(batch)), built.logits(batch))
    print(f"[parity] v3_full sharded (fsdp=2, expert=2, tensor=2): max|diff| = {d:.2e}")
    assert d < TOL
    # saving sharded params gathers them: the files equal those saved from the unsharded load
    cj.save_pretrained(params, cfg, tmp_path / "sharded")
    cj.save_pretrained(params0, cfg0, tmp_path / "plain")
    assert (tmp_path / "sharded" / "model.safetensors").read_bytes() == (
        tmp_path / "plain" / "model.safetensors"
    ).read_bytes()


def _mtp_checkpoint(built, out_dir):
    """v3_full plus one random DeepSeek MTP module at model.layers.3, in a second shard with an index."""
    state = load_file(str(built.path / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    rnd = lambda *s: 0.1 * torch.randn(*s, generator=g)
    n, d = 3, 32
    mtp = {
        f"model.layers.{n}.{k[len('model.layers.2.') :]}": v + rnd(*v.shape)
        for k, v in state.items()
        if k.startswith("model.layers.2.")
    }
    mtp.update(
        {
            f"model.layers.{n}.enorm.weight": 1 + rnd(d),
            f"model.layers.{n}.hnorm.weight": 1 + rnd(d),
            f"model.layers.{n}.eh_proj.weight": rnd(d, 2 * d),
            f"model.layers.{n}.shared_head.norm.weight": 1 + rnd(d),
            f"model.layers.{n}.shared_head.head.weight": state["lm_head.weight"].clone(),
            f"model.layers.{n}.embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
        }
    )
    save_file(state, str(out_dir / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(mtp, str(out_dir / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in state}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in mtp})
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.copy(built.path / "config.json", out_dir / "config.json")
    return mtp


def test_mtp_module_matches_reference(hf_checkpoint, tokens, tmp_path):
    """MTP weights load from model.layers.{L}; our mtp_logits equal DeepSeek-V3's MTP written out
    with transformers modules: Head(norm(Block(eh_proj[enorm(emb(t_{i+1})); hnorm(h_i)])))."""
    built = hf_checkpoint("v3_full")
    mtp = _mtp_checkpoint(built, tmp_path)
    cfg, params = cj.from_pretrained(tmp_path)
    assert cfg.num_mtp_layers == 1
    np.testing.assert_array_equal(
        np.asarray(params["mtp"]["eh_proj"][0]), mtp["model.layers.3.eh_proj.weight"].numpy().T
    )
    out = run(cfg, params, tokens)

    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    model, hcfg = built.model, built.model.config
    layer = DeepseekV3DecoderLayer(hcfg, layer_idx=3).eval()
    layer.load_state_dict(
        {
            k[len("model.layers.3.") :]: v
            for k, v in _fuse_experts(mtp).items()
            if k.split(".")[3] not in ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
        }
    )
    norms = {k: DeepseekV3RMSNorm(32, eps=hcfg.rms_norm_eps) for k in ("enorm", "hnorm", "shared_head.norm")}
    with torch.no_grad():
        for k, m in norms.items():
            m.weight.copy_(mtp[f"model.layers.3.{k}.weight"])
        t = torch.as_tensor(tokens, dtype=torch.long)
        h = model.model(t).last_hidden_state  # after the final norm, as DeepSeek's MTP consumes it
        nxt = torch.cat([t[:, 1:], torch.zeros_like(t[:, :1])], dim=1)
        x = torch.cat([norms["enorm"](model.model.embed_tokens(nxt)), norms["hnorm"](h)], dim=-1)
        x = x @ mtp["model.layers.3.eh_proj.weight"].T
        pos = torch.arange(t.shape[1])[None]
        y = layer(x, position_embeddings=model.model.rotary_emb(x, pos), attention_mask=None, position_ids=pos)
        ref = model.lm_head(norms["shared_head.norm"](y)).numpy()
    d = max_diff(out.mtp_logits[0], ref)
    print(f"[parity] v3_full MTP depth 1: max|diff| = {d:.2e}")
    assert d < TOL
    # saving writes the MTP module back under the same names (embedding / head copies included)
    save_dir = tmp_path / "saved"
    cj.save_pretrained(params, cfg, save_dir, max_shard_size="20KB")
    assert (save_dir / "model.safetensors.index.json").exists()
    cfg2, params2 = cj.from_pretrained(save_dir)
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    weight_map = json.loads((save_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(mtp) <= set(weight_map)


def _fuse_experts(state):
    """Hub per-expert tensors -> transformers' in-memory fused experts (for load_state_dict)."""
    out, experts = {}, {}
    for k, v in state.items():
        parts = k.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            experts.setdefault(".".join(parts[: i + 1]), {})[(int(parts[i + 1]), parts[i + 2])] = v
        else:
            out[k] = v
    for pre, ws in experts.items():
        e = 1 + max(i for i, _ in ws)
        out[pre + ".gate_up_proj"] = torch.stack(
            [torch.cat([ws[(i, "gate_proj")], ws[(i, "up_proj")]]) for i in range(e)]
        )
        out[pre + ".down_proj"] = torch.stack([ws[(i, "down_proj")] for i in range(e)])
    return out


def test_missing_mtp_weights_warn_and_drop(hf_checkpoint, caplog, monkeypatch):
    """transformers writes num_nextn_predict_layers=1 but no MTP tensors: load with 0 MTP layers.
    (The warning is once per directory per process, and the checkpoint is shared: start afresh.)"""
    monkeypatch.setattr(hf_ckpt, "_MTP_WARNED", set())
    built = hf_checkpoint("v3_full")
    assert json.loads((built.path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    with caplog.at_level("WARNING", logger=hf_ckpt.__name__):
        cfg, params = cj.from_pretrained(built.path)
    assert cfg.num_mtp_layers == 0 and "mtp" not in params
    assert "MTP" in caplog.text and "num_mtp_layers=0" in caplog.text


def test_bfloat16_load_and_save(hf_checkpoint, tokens, tmp_path):
    """dtype='bfloat16' casts weights (routers stay float32); a bf16 save reloads as bf16."""
    built = hf_checkpoint("qwen3_norm")
    cfg, params = cj.from_pretrained(built.path, dtype="bfloat16")
    assert params["embed"].dtype == jnp.bfloat16 and params["moe_layers"]["moe"]["router"].dtype == jnp.float32
    cj.save_pretrained(params, cfg, tmp_path)
    cfg2, params2 = cj.from_pretrained(tmp_path)
    assert cfg2.param_dtype == "bfloat16" and params2["embed"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(params2["embed"]), np.asarray(params["embed"]))
