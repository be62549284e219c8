"""Checkpoints of the training state: orbax save and exact resume (`manager`), and the checks run
before a restore (`validate`). Hugging Face interop is `composer_jax.hf`; weight transfer to samplers
is `composer_jax.weightsync`."""
