"""Mixture of experts, as named parts: `params` (one block's parameter specs), `router` (which
experts, with what gate weight, and the balance statistics), `dispatch` (the choice of how a block
computes its routed experts), `grouped` (the dropless grouped-matmul implementations),
`expert_parallel` (the exchange over the expert mesh axis), `decode` (the inference-step kernels)
and `layer` (`moe_layer`, which puts them together). It imports nothing of the rest of `model/`."""
