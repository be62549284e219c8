"""Modules that run inside vLLM's own virtualenv: `composer-jax vllm-replica` puts this directory on
vLLM's PYTHONPATH, so each module here is imported there by its bare name and uses the standard
library only (vLLM's environment has none of the project's packages)."""
