"""Weight transfer from the trainer to the samplers: the versioned tensorstore weight store (base
snapshots plus XOR deltas), the per-shard publisher every trainer process writes through, the
subscriber a sampler loads versions with, and NCCL transport to running vLLM replicas."""
