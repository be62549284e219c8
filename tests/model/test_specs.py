"""The one spec machinery (`composer_jax/specs.py`): the KV cache's and the step's batch shardings on the
8-device mesh equal placements written out by hand, parameters' abstract arrays equal what their
init traces to, and a spec whose logical axes do not match its shape fails naming the array."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from support.small_models import gqa

import composer_jax as cj
from composer_jax import specs
from composer_jax.config import Config, TrainConfig
from composer_jax.model.kv_cache import cache_specs, init_cache
from composer_jax.model.params import abstract_params, init_fn
from composer_jax.specs import ArraySpec, ParamSpec
from composer_jax.train.step import batch_sharding, batch_specs

MLA = cj.ModelConfig(num_layers=3, num_mtp_layers=0, max_position_embeddings=64)  # first_k_dense=1
GQA = gqa(MLA)
BATCH = ("data", "fsdp")  # act_batch -> (data, fsdp, expert); expert has size 1 on this mesh


@pytest.fixture(scope="module")
def mesh():
    return cj.make_mesh(cj.MeshConfig(data=2, fsdp=2, expert=1, context=1, tensor=2))


def _specs_of(tree):
    return jax.tree.map(lambda s: s.spec, tree)


def test_mla_cache_shardings_written_out(mesh):
    # rows over data x fsdp (4 divides 4); the latent's kv_lora and the rotary key stay whole
    got = _specs_of(specs.shardings(cache_specs(MLA, batch=4, max_len=16), mesh))
    row = P(None, BATCH, None, None)
    assert got.layers == {"dense_layers": {"latent": row, "k_rope": row}, "moe_layers": {"latent": row, "k_rope": row}}
    assert got.lengths == P(BATCH)


def test_gqa_cache_shardings_written_out(mesh):
    # batch 2: data (2) divides it, data x fsdp (4) does not, so fsdp is dropped; kv heads over tensor
    assert GQA.num_kv_heads % 2 == 0
    got = _specs_of(specs.shardings(cache_specs(GQA, batch=2, max_len=16), mesh))
    kv = P(None, "data", None, "tensor", None)
    assert got.layers["moe_layers"] == {"k": kv, "v": kv} and got.layers["dense_layers"] == {"k": kv, "v": kv}
    assert got.lengths == P("data")


def test_init_cache_is_zeros_on_those_shardings(mesh):
    cache = init_cache(MLA, 4, 16, mesh)
    latent = cache.layers["moe_layers"]["latent"]
    assert latent.shape == (MLA.num_moe_layers, 4, 16, MLA.kv_lora_rank)
    assert latent.dtype == jnp.dtype(MLA.compute_dtype) and cache.lengths.dtype == jnp.int32
    assert latent.sharding.spec == P(None, BATCH, None, None) and cache.lengths.sharding.spec == P(BATCH)
    assert not jnp.any(latent) and not jnp.any(cache.lengths)
    mtp = cache_specs(dataclasses.replace(MLA, num_mtp_layers=1), 4, 16, mtp_modules=1)
    assert list(mtp.layers) == ["mtp"] and mtp.layers["mtp"]["latent"].shape[0] == 1


def test_batch_shardings_written_out():
    mesh = cj.make_mesh(cj.MeshConfig(data=2, fsdp=2, expert=1, context=2, tensor=1))
    cfg = Config(train=TrainConfig(batch_size=8, seq_len=16))
    got = _specs_of(specs.shardings(batch_specs(cfg, ("tokens", "routing")), mesh))
    assert got == {"tokens": P(BATCH, "context"), "routing": P(BATCH, "context")}
    # a [batch, seq, moe_layers, k] array: trailing axes whole
    assert batch_sharding(mesh, cj.ShardingRules.create(), (8, 16, 3, 2)).spec == P(BATCH, "context", None, None)


def test_abstract_params_equal_what_init_traces_to():
    traced = jax.eval_shape(init_fn(MLA), jax.random.key(0))
    got = abstract_params(MLA)
    assert jax.tree.structure(got) == jax.tree.structure(traced)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(traced)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
    assert got["moe_layers"]["moe"]["router"].dtype == jnp.float32  # a spec's own dtype wins


def test_a_spec_whose_axes_miss_a_dimension_names_the_array(mesh):
    bad = {"cache": {"k": ArraySpec((2, 3), ("act_batch",))}}
    want = r"array spec 'cache/k': shape \(2, 3\) has 2 dimensions but logical axes \('act_batch',\) name 1"
    with pytest.raises(ValueError, match=want):
        specs.shardings(bad, mesh)
    with pytest.raises(ValueError, match=want):
        specs.zeros(bad, "float32")
    params = {"moe_layers": {"attn": {"q": ParamSpec((4, 8), ("embed", "heads", "head_dim"))}}}
    with pytest.raises(ValueError, match=r"array spec 'moe_layers/attn/q': shape \(4, 8\) has 2 dimensions"):
        specs.abstract(params, "float32")
