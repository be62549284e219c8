"""What the train step optimises: an `Objective` is three pure functions the step receives.

The step (`train/step.py`) owns everything that does not depend on the loss: splitting the batch
into micro-batches, the sharding of every input, gradient accumulation, the optimiser, the
router-bias update and the skip of non-finite updates. An objective owns the rest:

- `prepare(params, batch, cfg, context) -> (arrays, denominators)`: the pipeline batch turned
  into per-token model inputs, targets and weights (every array's last two axes are
  [batch, seq], in the layout order of the context-parallel split, unless `prepared_axes` gives
  its logical axes: the RL objective's recorded routing is [moe_layers, batch, seq, k], the
  layout the model's layer scan reads), and the whole-batch denominators of its terms.
- `terms(params, micro_batch, cfg, denominators, sharding) -> (objective, sums)`: one
  micro-batch's contribution. Each term is a sum over the micro-batch's tokens divided by a
  whole-batch denominator from `prepare` - Tunix's (sum, denominator) pair with the denominator
  known up front - so the micro-batches' contributions add up to exactly the whole-batch
  objective, whichever terms (several, with different denominators) it has. `sums` are metric
  sums added over micro-batches; the model's `expert_counts` / `mtp_expert_counts` /
  `seq_balance`, when present, drive the router-bias update and the MoE metrics.
- `metrics(sums, denominators, cfg) -> dict`: the logged values of this objective.

The pretraining objective is `train.pretrain.PRETRAINING`; the RL objective plugs in the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax

from composer_jax.config import Config
from composer_jax.sharding import MeshRules

Prepare = Callable[[Any, dict, Config, int], tuple[dict, dict]]
Terms = Callable[[Any, dict, Config, dict, "MeshRules | None"], tuple[jax.Array, dict]]
Metrics = Callable[[dict, dict, Config], dict]


@dataclasses.dataclass(frozen=True)
class Objective:
    """A training objective (see the module docstring for each function's contract).

    batch_keys: the keys of the pipeline batch the step receives ([batch, seq] arrays each).
    prepared_axes: the logical axes ("act_batch" and "act_seq" among them) of each prepared array
    not laid out [..., batch, seq]; the step splits micro-batches and shards by them."""

    name: str
    batch_keys: tuple[str, ...]
    prepare: Prepare
    terms: Terms
    metrics: Metrics
    prepared_axes: Mapping[str, tuple[str | None, ...]] = dataclasses.field(default_factory=dict)

    def axes_of(self, key: str, ndim: int) -> tuple[str | None, ...]:
        """The logical axes of prepared array `key` (default: [..., batch, seq])."""
        return self.prepared_axes.get(key, (None,) * (ndim - 2) + ("act_batch", "act_seq"))
