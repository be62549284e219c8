"""Training: state, optimiser, losses, the sharded step, and the loop."""
