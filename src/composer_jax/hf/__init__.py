"""Hugging Face interop: config.json mapping, lazy safetensors (DeepSeek FP8 blocks), weights in and
out (`from_pretrained`, `save_pretrained`), complete exports with tokenizer files and chat template,
exact MLA padding for vLLM, YaRN fields, and `composer-jax convert`."""
