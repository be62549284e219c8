"""LoRA (model/lora.py, train.lora): the adapter math against numpy, the adapted forward against
the merged model, and a train step that moves the adapters only (the base and its router biases
unchanged, AdamW's moments over the adapters alone)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import composer_jax as cj
from composer_jax.config import ConfigError, LoraConfig, validate_lora
from composer_jax.model import lora
from composer_jax.model.params import init_params
from composer_jax.train.objective import Objective
from composer_jax.train.state import init_train_state, optimizer_for
from composer_jax.train.step import make_train_step

TINY = Path(__file__).resolve().parents[2] / "configs" / "model" / "tiny.yaml"
# the tiny model cut to one dense and one MoE layer, no MTP: compile time is these tests' cost
SMALL = ["model.num_layers=2", "model.num_mtp_layers=0"]
ALL = [*SMALL, "train.lora.rank=4", "train.lora.alpha=8", "train.lora.targets=[attention,mlp,experts]"]


def _cfg(extra=()):
    return cj.load_config(TINY, [*ALL, *extra], num_devices=8)


def _random_adapters(cfg, seed=1):
    """Adapters with B nonzero too (fresh ones have B = 0 and change nothing)."""
    tree = lora.init_adapters(cfg.model, cfg.train.lora, jax.random.key(seed))
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree.unflatten(treedef, [0.1 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


def test_adapter_math_against_numpy():
    """adapted_linear = x W + (x A) B' and merged_weight = W + A B' (B' = scale B), with o's two
    contracted axes and the experts' batch axis, against numpy."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 4, 5)).astype(np.float32)  # [b, s, heads, head_dim] into o
    w = rng.normal(size=(4, 5, 6)).astype(np.float32)
    a = rng.normal(size=(4, 5, 2)).astype(np.float32)
    b = rng.normal(size=(2, 6)).astype(np.float32)
    p = lora.join({"o": jnp.asarray(w)}, {"lora": {"o": {"a": jnp.asarray(a), "b": jnp.asarray(b)}}}, 1.5)
    y = np.asarray(lora.adapted_linear(jnp.asarray(x), p, "o", contract=2))
    flat = x.reshape(6, 20)
    ref = flat @ w.reshape(20, 6) + 1.5 * (flat @ a.reshape(20, 2)) @ b
    np.testing.assert_allclose(y.reshape(6, 6), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(lora.merged_weight(p, "o")), w + 1.5 * np.einsum("hvr,ro->hvo", a, b), rtol=1e-5, atol=1e-5
    )
    we, ae, be = (rng.normal(size=s).astype(np.float32) for s in ((3, 4, 5), (3, 4, 2), (3, 2, 5)))
    pe = lora.join({"gate": jnp.asarray(we)}, {"lora": {"gate": {"a": jnp.asarray(ae), "b": jnp.asarray(be)}}}, 2.0)
    np.testing.assert_allclose(
        np.asarray(lora.merged_weight(pe, "gate")), we + 2.0 * np.einsum("edr,erf->edf", ae, be), rtol=1e-5
    )


def test_adapter_tree_fresh_adapters_and_optimizer_state():
    """The adapter tree's paths and shapes; fresh B is zero (the adapted model starts as the
    base); AdamW's moments (abstract: nothing compiled) have the adapters' structure alone."""
    cfg = _cfg()
    specs = lora.adapter_specs(cfg.model, cfg.train.lora)
    assert sorted(specs["moe_layers"]["attn"]["lora"]) == ["kv_a", "kv_b", "o", "q_a", "q_b"]
    assert sorted(specs["dense_layers"]) == ["attn", "mlp"] and "moe" not in specs["dense_layers"]
    gate = specs["moe_layers"]["moe"]["lora"]["gate"]
    assert gate["a"].shape == (1, 8, 64, 4) and gate["b"].shape == (1, 8, 4, 32)
    o = specs["moe_layers"]["attn"]["lora"]["o"]
    assert o["a"].shape == (1, 4, 16, 4) and o["b"].shape == (1, 4, 64)
    fresh = lora.init_adapters(cfg.model, cfg.train.lora, jax.random.key(1))
    for path, x in jax.tree_util.tree_leaves_with_path(fresh):
        assert bool(jnp.all(x == 0)) == (path[-1].key == "b")
    abstract = lora.abstract_adapters(cfg.model, cfg.train.lora)
    opt = jax.eval_shape(optimizer_for(cfg).init, abstract)
    moments = [n for n in jax.tree.leaves(opt, is_leaf=lambda n: hasattr(n, "mu")) if hasattr(n, "mu")]
    assert moments and all(jax.tree.structure(m.mu) == jax.tree.structure(abstract) for m in moments)
    n_opt = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(opt))
    assert n_opt < 3 * sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract)) + 16


@pytest.mark.slow
def test_adapted_forward_equals_merged_model():
    """(slow: 8-9 s of compiling; `test_adapter_math_against_numpy` keeps the math in the default
    suite.) The training forward (factored attention / MLP adapters, merged experts) equals the forward
    of the merged plain tree, and the cached forward of a joined tree (it merges first)."""
    cfg = _cfg()
    base = init_params(cfg.model, jax.random.key(0))
    adapters = _random_adapters(cfg)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 12)), jnp.int32)
    scale = cfg.train.lora.scale

    @jax.jit
    def logits(base, adapters):
        plain = lambda p: cj.forward(p, tokens, cfg.model).logits
        return plain(lora.join(base, adapters, scale)), plain(lora.merged(base, adapters, scale))

    ours, plain = logits(base, adapters)
    delta = lora.merged(base, adapters, scale)["moe_layers"]["attn"]["o"] - base["moe_layers"]["attn"]["o"]
    assert float(jnp.max(jnp.abs(delta))) > 1e-3  # the adapters matter
    np.testing.assert_allclose(np.asarray(ours), np.asarray(plain), rtol=1e-4, atol=1e-4)


def _nll_terms(params, mb, cfg, denoms, sharding):
    out = cj.forward(params, mb["tokens"], cfg.model, sharding=sharding)
    logp = jax.nn.log_softmax(out.logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, mb["tokens"][:, 1:, None], axis=-1)[..., 0].sum()
    return nll / denoms["n"], {
        "nll": nll,
        "expert_counts": out.aux["expert_counts"],
        "seq_balance": out.aux["seq_balance"],
    }


NLL = Objective(
    "nll",
    ("tokens",),
    lambda p, b, c, ctx: ({"tokens": b["tokens"].astype(jnp.int32)}, {"n": jnp.asarray(b["tokens"].size, jnp.float32)}),
    _nll_terms,
    lambda s, d, c: {"nll": s["nll"] / d["n"]},
)


@pytest.mark.slow
def test_train_step_moves_only_the_adapters():
    """(slow: 13-17 s of compiling a train step; the default suite keeps the optimiser-state half in
    `test_adapter_tree_fresh_adapters_and_optimizer_state`, and `tests/hf/test_lora_peft.py`'s
    default test the adapters' forward.) Two steps of the train step with `train.lora` change
    every adapter leaf and no leaf of the frozen base."""
    cfg = _cfg(["train.batch_size=8", "train.seq_len=16", "train.optimizer.warmup_steps=0"])
    mesh = cj.make_mesh(cfg.mesh)
    rules = cj.ShardingRules.create()
    state = init_train_state(cfg, mesh, rules)
    base_before = jax.device_get(state.frozen)
    adapters_before = jax.device_get(state.params)
    # AdamW's moments hold the adapters alone
    adapter_structure = jax.tree.structure(state.params)
    moments = [n for n in jax.tree.leaves(state.opt_state, is_leaf=lambda n: hasattr(n, "mu")) if hasattr(n, "mu")]
    assert moments and all(jax.tree.structure(m.mu) == adapter_structure for m in moments)
    step = make_train_step(cfg, mesh, rules, objective=NLL)
    tokens = np.random.default_rng(0).integers(0, 512, (8, 16)).astype(np.int32)
    with jax.set_mesh(mesh):
        for _ in range(2):
            state, metrics = step(state, {"tokens": tokens})
    assert int(metrics["skipped"]) == 0
    for u, v in zip(jax.tree.leaves(jax.device_get(state.frozen)), jax.tree.leaves(base_before)):
        np.testing.assert_array_equal(u, v)  # the base (router biases included) is untouched
    changed = [
        not np.array_equal(u, v)
        for u, v in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(adapters_before))
    ]
    assert all(changed)  # every A and B moved (B from zero; A once B is nonzero)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"rank": -1}, "train.lora.rank=-1"),
        ({"rank": 4, "alpha": 0.0}, "train.lora.alpha=0.0"),
        ({"dropout": 0.1}, "accepted: 0"),
        ({"rank": 4, "targets": ("q_proj",)}, "'q_proj'"),
    ],
)
def test_bad_lora_config_is_refused(change, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[")):
        validate_lora(dataclasses.replace(LoraConfig(), **change))


def test_target_the_model_lacks_is_refused():
    with pytest.raises(ConfigError, match="'q'.*accepted"):
        cj.load_config(TINY, ["train.lora.rank=4", "train.lora.targets=[q]"], num_devices=8)
