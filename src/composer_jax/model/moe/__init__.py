"""Mixture of experts, as named parts: `router` (which experts, with what gate weight, and the
balance statistics), `dispatch` (the choice of how a block computes its routed experts), `grouped`
(the dropless grouped-matmul implementations), `expert_parallel` (the exchange over the expert mesh
axis), `decode` (the inference-step kernels) and `layer` (`moe_layer`, which puts them together)."""
