"""The MoE transformer as pure functions over an explicit parameter pytree."""
