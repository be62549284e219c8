"""What the RL tests share about environment servers (started with `rl.envs.LocalEnvServers`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV_FIXTURE_TASKS = REPO / "tests" / "env" / "fixtures" / "tasks"
HAVE_BWRAP = shutil.which("bwrap") is not None
needs_bwrap = pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap (bwrap) is not installed; `make system-deps`")
