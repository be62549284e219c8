"""Where rollouts are sampled. `base.SamplerBackend` is the one interface the rollout side uses
(publish a version, load it, health, close; its policies' turns), with one implementation per
backend: `in_process` (the continuous-batching sampler in the trainer's process), `serve`
(`composer-jax serve` replicas; started by `serve_launch`) and `vllm` (vLLM replicas; started by
`vllm_launch`, whose child process is `vllm_child`, or fed over NCCL by `vllm_nccl`); `engines` is
the registry of those three engines, picked from the config by `engine_of`. `policy` holds
the agent-facing policy types (`Generation`, `TurnRequest`, `PolicyPool`, the OpenAI endpoint policy
for evaluation)."""
