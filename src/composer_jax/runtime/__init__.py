"""Child processes a run supervises on one machine (environment servers, `serve` and vLLM replicas):
the ready line, the parent-death signal, restarts with backoff, health probes. Neither RL nor the
environment server: both kinds of child are started through it."""
