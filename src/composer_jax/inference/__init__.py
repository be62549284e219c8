"""Inference for rollouts: sampling (`sampling.py`) and the continuous-batching sampler over the
KV cache with in-flight weight updates and routed-expert capture (`sampler.py`)."""
