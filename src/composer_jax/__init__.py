"""composer_jax: a JAX reimplementation of the Composer 2 agentic-coding training stack.

The public API (see docs/architecture.md)::

    import composer_jax as cj
    cfg = cj.load_config("configs/model/tiny.yaml", overrides=["model.num_layers=2"])
    mesh = cj.make_mesh(cfg.mesh)
    params = cj.init_params(cfg.model, jax.random.key(0), mesh)
    out = cj.forward(params, tokens, cfg.model)
    cfg_m, params = cj.from_pretrained("path/to/hf_dir", mesh)
    cj.save_pretrained(params, cfg_m, "out_dir")

Names are resolved lazily so that `composer_jax.env` (the environment server, which must run on a
CPU box without JAX) can be imported without importing JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "load_config": "composer_jax.config",
    "Config": "composer_jax.config",
    "ModelConfig": "composer_jax.config",
    "MeshConfig": "composer_jax.config",
    "ConfigError": "composer_jax.config",
    "make_mesh": "composer_jax.sharding",
    "ShardingRules": "composer_jax.sharding",
    "MeshRules": "composer_jax.sharding",
    "init_params": "composer_jax.model.params",
    "param_specs": "composer_jax.model.params",
    "forward": "composer_jax.model.transformer",
    "ModelOutput": "composer_jax.model.transformer",
    "from_pretrained": "composer_jax.hf.weights",
    "save_pretrained": "composer_jax.hf.weights",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'composer_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
