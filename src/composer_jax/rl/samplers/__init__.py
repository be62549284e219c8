"""Where rollouts are sampled: the policy types the agent loop talks to, and the sampler backends
(in-process, `composer-jax serve` replicas, vLLM replicas) with their launch and weight loading."""
