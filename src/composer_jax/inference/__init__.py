"""Inference: the engine that samples from a policy (`engine/`) and the server that exposes it
(`server/`, `composer-jax serve` / `sample`). The engine imports nothing of the server
(tests/test_layers.py); docs/architecture.md says why the boundary sits where it does."""
