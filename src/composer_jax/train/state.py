"""TrainState: everything a training step reads and writes, as one pytree."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.config import Config
from composer_jax.model.lora import abstract_adapters, adapter_shardings, init_adapters, merged
from composer_jax.model.params import abstract_params, init_params, param_shardings
from composer_jax.model.quant_base import base_shardings, dequantized_base, quantized_base
from composer_jax.sharding import ShardingRules
from composer_jax.train.optimizer import make_optimizer


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """step: int32[]; params: the trained pytree (the model's parameters; with `train.lora` the
    adapters, `model.lora`); opt_state: optax state (moments shaped and sharded like params); rng:
    uint32[2] raw key data (raw so that checkpoints hold plain arrays); frozen: with `train.lora`,
    the frozen base the adapters apply to (never checkpointed: `checkpointed`), else None; with
    `train.lora.base_format` its linear kernels are `quant_base.QuantWeight`s.

    The same container also holds the state's shardings or ShapeDtypeStructs, leaf for leaf
    (`state_shardings`, `abstract_train_state`), hence the `Any` leaves."""

    step: Any
    params: Any
    opt_state: Any
    rng: Any
    frozen: Any = None

    def model_params(self, cfg: Config) -> Any:
        """The plain parameter tree of the model being trained (the adapters merged into the base
        with `train.lora`, a quantised base dequantised first: the numbers the step computes
        with): what samplers, evaluations and exports compute with."""
        if self.frozen is None:
            return self.params
        return merged(dequantized_base(self.frozen), self.params, cfg.train.lora.scale)

    def checkpointed(self) -> TrainState:
        """What a checkpoint holds: the state without the frozen base (its identity is recorded
        with the checkpoint instead)."""
        return dataclasses.replace(self, frozen=None)


def optimizer_for(cfg: Config) -> optax.GradientTransformation:
    return make_optimizer(cfg.train.optimizer, cfg.train.steps, cfg.model, cfg.train.lora)


def _trained_shardings(cfg: Config, mesh: Mesh, rules: ShardingRules) -> tuple[Any, Any]:
    """(shardings, abstract shapes) of the trained tree: the parameters, or the adapters."""
    if cfg.train.lora.enabled:
        return adapter_shardings(cfg.model, cfg.train.lora, mesh, rules), abstract_adapters(cfg.model, cfg.train.lora)
    return param_shardings(cfg.model, mesh, rules), abstract_params(cfg.model)


def _replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def state_shardings(cfg: Config, mesh: Mesh, rules: ShardingRules) -> TrainState:
    """Shardings of every leaf, by structure: each subtree of the optimiser state that has the
    parameters' exact tree structure (AdamW's moments) takes the parameters' shardings, leaf for
    leaf; everything else (step counts) is replicated. With `train.lora` the trained tree is
    the adapters and the frozen base takes the parameters' shardings."""
    p_sh, abstract = _trained_shardings(cfg, mesh, rules)
    params_def: Any = jax.tree.structure(abstract)  # (jaxlib's PyTreeDef stub lacks __eq__)
    opt_shapes = jax.eval_shape(optimizer_for(cfg).init, abstract)
    like_params = lambda node: not isinstance(node, jax.ShapeDtypeStruct) and params_def == jax.tree.structure(node)
    opt_sh = jax.tree.map(
        lambda node: p_sh if like_params(node) else _replicated(mesh), opt_shapes, is_leaf=like_params
    )
    lora = cfg.train.lora
    frozen = base_shardings(cfg.model, lora.base_format, mesh, rules) if lora.enabled else None
    return TrainState(step=_replicated(mesh), params=p_sh, opt_state=opt_sh, rng=_replicated(mesh), frozen=frozen)


def init_train_state(cfg: Config, mesh: Mesh, rules: ShardingRules, params: Any | None = None) -> TrainState:
    """A fresh state (or fresh optimiser around given params), created directly on its shardings.
    With `train.lora`, `params` (or a fresh model) is the frozen base and fresh adapters are
    trained."""
    shardings = state_shardings(cfg, mesh, rules)
    key = jax.random.key(cfg.train.seed)
    if params is None:
        params = init_params(cfg.model, key, mesh, rules)
    tx = optimizer_for(cfg)
    frozen = None
    if cfg.train.lora.enabled:
        frozen = frozen_base(cfg, params, mesh, rules)
        params = init_adapters(cfg.model, cfg.train.lora, jax.random.fold_in(key, 2), mesh, rules)

    def make(params, frozen):
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            rng=jax.random.key_data(jax.random.fold_in(key, 1)),
            frozen=frozen,
        )

    return jax.jit(make, out_shardings=shardings)(params, frozen)


def frozen_base(cfg: Config, params: Any, mesh: Mesh, rules: ShardingRules) -> Any:
    """A LoRA run's frozen base from the float `params` it starts from (or resumes over): stored
    as `train.lora.base_format` says (`model.quant_base`; quantised once, here), else as given."""
    return quantized_base(params, cfg.model, cfg.train.lora.base_format, mesh, rules)


def abstract_train_state(cfg: Config, mesh: Mesh, rules: ShardingRules) -> TrainState:
    """ShapeDtypeStructs with shardings of the whole state as checkpoints hold it (for restore;
    with `train.lora`: the adapters, no frozen base); nothing allocated."""
    shardings = state_shardings(cfg, mesh, rules).checkpointed()
    tx = optimizer_for(cfg)
    lora = cfg.train.lora

    def make(key):
        params = init_adapters(cfg.model, lora, key) if lora.enabled else init_params(cfg.model, key)
        return TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=jax.random.key_data(key)
        )

    shapes = jax.eval_shape(make, jax.random.key(0))
    return jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), shapes, shardings)
