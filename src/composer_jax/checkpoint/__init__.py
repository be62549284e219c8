"""Checkpoints: orbax save/restore of the train state (`manager`), Hugging Face safetensors
import/export (`hf`), and the `composer-jax convert` CLI (`convert`)."""
