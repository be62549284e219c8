"""The environment service's public surface: the tool protocol, the asyncio client and the error types.
The only part of `composer_jax.env` that the rest of the project (formats, data, rl, the entry
layer) may import; tests/test_layers.py reads this package to know what is public."""
