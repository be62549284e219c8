"""Where an agent's commands run: bubblewrap (or local) sandboxes with cgroup budgets, size-limited
volumes, the confined workspace, snapshots and diffs, and the per-task Python environment builds."""
