"""The model as a Flax NNX module: the parameter tree held as `nnx.Param`s, `__call__` = `forward`.

The pure functions stay the model (`model/transformer.py`, `model/params.py`); this module only
holds their parameter tree the way Flax NNX code expects, so an NNX training loop (`nnx.grad`,
`nnx.Optimizer`, Tunix's learners) can hold, split, shard and call it:

    model = ComposerTransformer(cfg, rngs=nnx.Rngs(0), sharding=MeshRules(mesh, rules))
    out = model(tokens)                                  # ModelOutput, as forward(params, tokens, cfg)
    graphdef, state = nnx.split(model)                   # state: the parameter tree (nnx.State)
    nnx.get_partition_spec(state)                        # the project's PartitionSpecs, leaf by leaf
    grads = nnx.grad(lambda m: loss(m(tokens)))(model)   # the trainable Params (router biases excluded)

Every leaf carries its `ParamSpec`'s logical axes as flax's sharding annotation (`out_sharding`,
what `nnx.with_partitioning` sets) and, with a mesh, the resolution of those axes that
`ShardingRules` made for that leaf (`sharding_rules`: mesh axes that do not divide a dimension are
dropped, as the project's shardings drop them), so `nnx.get_partition_spec` / `get_named_sharding`
give exactly `params.param_shardings`. Values are created by `params.init_params` (each on its
devices), never resharded by flax (`eager_sharding=False`). The router's score-correction bias is a
`RouterBias` variable, not a `Param`: it has no gradient and no optimiser (`gradient_free_mask`),
which is what NNX's `wrt=nnx.Param` filters then express.

Flax is imported here only; nothing else in the package imports this module (the environment
server and the pure-function paths run without flax).
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from composer_jax.config import ModelConfig
from composer_jax.model.params import init_params, param_specs
from composer_jax.model.transformer import ModelOutput, forward
from composer_jax.sharding import MeshRules
from composer_jax.specs import ParamSpec, path_str


class RouterBias(nnx.Variable):
    """DeepSeek-V3's router score-correction bias: moved by `params.update_router_biases` from the
    expert counts, never by gradients (`params.gradient_free_mask`)."""


def _is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _leaf_rules(spec: ParamSpec, sharding: MeshRules) -> tuple[tuple[str, Any], ...]:
    """(logical axis, mesh axes) for this leaf's axes as `ShardingRules` places them on the mesh."""
    placed = sharding.spec(spec.logical_axes, spec.shape)
    out: dict[str, Any] = {}
    for name, entry in zip(spec.logical_axes, placed):
        if name in out and out[name] != entry:  # one name resolved two ways in one array: not expressible
            raise ValueError(
                f"logical axis {name!r} appears twice in a parameter of shape {spec.shape} with different "
                f"placements ({out[name]!r}, {entry!r}); flax's per-variable rules map a name one way"
            )
        out[name] = entry
    return tuple(out.items())


def _variable(value: jax.Array, spec: ParamSpec, sharding: MeshRules | None) -> nnx.Variable:
    cls = RouterBias if spec.role == "router_bias" else nnx.Param
    meta: dict[str, Any] = {"out_sharding": spec.logical_axes, "role": spec.role, "eager_sharding": False}
    if sharding is not None:
        meta["sharding_rules"] = _leaf_rules(spec, sharding)
        meta["mesh"] = sharding.mesh
    return cls(value, **meta)


class ComposerTransformer(nnx.Module):
    """`forward` as an NNX module over `param_specs(cfg)`'s tree (nested dicts of variables).

    ComposerTransformer(cfg, rngs=nnx.Rngs(seed)) initialises like `init_params(cfg, key)` with
    key = rngs.params(); `ComposerTransformer.from_params(cfg, params)` wraps an existing tree (a
    checkpoint, `from_pretrained`); `params()` gives the plain tree back for the pure functions.
    sharding: the mesh and rules the parameters are placed by and `forward` runs under (None:
    one device, or the mesh set with `jax.set_mesh` at call time, as `forward` resolves it)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs | None = None,
        params: dict | None = None,
        sharding: MeshRules | None = None,
    ):
        if (rngs is None) == (params is None):
            raise ValueError(
                "ComposerTransformer needs exactly one of rngs= (initialise) or params= (wrap a tree); "
                f"got rngs={'set' if rngs is not None else None}, params={'set' if params is not None else None}"
            )
        if params is None:
            assert rngs is not None
            mesh, rules = (None, None) if sharding is None else (sharding.mesh, sharding.rules)
            params = init_params(cfg, rngs.params(), mesh, rules)  # type: ignore[arg-type]
        specs = param_specs(cfg)
        paths = lambda tree, leaf=None: {path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree, leaf)}
        want, got = paths(specs, _is_spec), paths(params)
        if want != got:
            raise ValueError(
                f"params do not have the structure of param_specs(cfg) for model {cfg.name!r}: "
                f"missing {sorted(want - got)}, unexpected {sorted(got - want)}"
            )
        for spec, value in zip(jax.tree.leaves(specs, is_leaf=_is_spec), jax.tree.leaves(params)):
            if tuple(value.shape) != spec.shape:
                raise ValueError(f"a parameter has shape {tuple(value.shape)}, param_specs(cfg) says {spec.shape}")
        self.cfg = nnx.static(cfg)
        self.sharding = nnx.static(sharding)
        self.tree = nnx.data(jax.tree.map(lambda s, v: _variable(v, s, sharding), specs, params, is_leaf=_is_spec))

    @classmethod
    def from_params(cls, cfg: ModelConfig, params: dict, sharding: MeshRules | None = None) -> ComposerTransformer:
        return cls(cfg, params=params, sharding=sharding)

    def params(self) -> dict:
        """The parameter tree as plain arrays (the pure functions' `params`)."""
        return jax.tree.map(lambda v: v.get_value(), self.tree, is_leaf=_is_variable)

    def __call__(self, tokens: jax.Array, **kwargs: Any) -> ModelOutput:
        """`forward(self.params(), tokens, cfg, sharding=..., **kwargs)`; kwargs as `forward`'s
        (segment_ids, positions, routing, ...)."""
        if "sharding" in kwargs:
            raise ValueError("ComposerTransformer runs under its own sharding; pass sharding= to the constructor")
        return forward(self.params(), tokens, self.cfg, sharding=self.sharding, **kwargs)
