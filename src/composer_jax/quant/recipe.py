"""Recipes of the quantised grouped matmul: how each product (forward, dgrad, wgrad) is quantised and
on which backend (`grouped_matmul.py` says what each recipe computes). Both backends read it, so it
sits below them.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from composer_jax.config.model import MOE_PRECISIONS, MOE_QUANT_BACKENDS, MoePrecision
from composer_jax.quant.formats import ScaleRule

# the names of model.moe_precision and model.moe_quant_backend, written once in config/model.py
RecipeName = MoePrecision
RECIPES = MOE_PRECISIONS
BACKENDS = MOE_QUANT_BACKENDS


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How each product of a grouped matmul is quantised (hashable: a static argument)."""

    fwd: Literal["none", "mxfp8", "nvfp4"]
    bwd: Literal["none", "mxfp8"]
    nvfp4_second: Literal["token", "tensor"] = "token"  # activations' second-level NVFP4 scale
    mx_rule: ScaleRule = "ceil"
    backend: Literal["xla", "pallas"] = "xla"


def recipe(name: str, **overrides) -> Recipe:
    """The named recipe (`RECIPES`), with field overrides (e.g. nvfp4_second="tensor")."""
    base = {
        "bf16": Recipe("none", "none"),
        "mxfp8": Recipe("mxfp8", "mxfp8"),
        "nvfp4_fwd_mxfp8_bwd": Recipe("nvfp4", "mxfp8"),
    }
    if name not in base:
        raise ValueError(f"MoE precision {name!r} is not accepted; accepted: {', '.join(RECIPES)}")
    r = dataclasses.replace(base[name], **overrides)
    if r.backend not in BACKENDS:
        raise ValueError(f"grouped matmul backend {r.backend!r} is not accepted; accepted: {', '.join(BACKENDS)}")
    if r.backend == "pallas" and (r.fwd == "none" or r.bwd != "mxfp8"):
        raise ValueError(f"backend 'pallas' runs the recipes mxfp8 and nvfp4_fwd_mxfp8_bwd, not {name!r}")
    return r


def as_recipe(precision: str | Recipe) -> Recipe:
    """A `Recipe` as it is, a recipe name through `recipe`."""
    return precision if isinstance(precision, Recipe) else recipe(precision)
