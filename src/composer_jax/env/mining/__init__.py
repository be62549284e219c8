"""Task authoring from real repositories: reading git history, writing statements, the task writer,
the verifier runner copied into each task, `env mine` and `env import-swebench`."""
