"""What the RL tests share about environment servers (started with `rl.envs.LocalEnvServers`); whether
they can run (bubblewrap) is support/bwrap.py's."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENV_FIXTURE_TASKS = REPO / "tests" / "env" / "fixtures" / "tasks"
