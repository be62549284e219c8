"""Checkpoints: Hugging Face safetensors import/export (`hf`), the `composer-jax convert` CLI."""
from composer_jax.checkpoint.hf import CheckpointError, from_pretrained, save_pretrained

__all__ = ["CheckpointError", "from_pretrained", "save_pretrained"]
