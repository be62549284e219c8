"""`rl.env_grade_cache`: the environment servers a run starts get `--grade-cache N` (the cache
itself: tests/env/tasks/test_grade_cache.py)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from composer_jax.config import load_config
from composer_jax.rl.rollout import side

CONFIG = Path(__file__).resolve().parents[1] / "fixtures" / "rl_pick.yaml"


@pytest.mark.parametrize("n, flags", [(0, ()), (7, ("--grade-cache", "7"))])
def test_the_run_starts_its_env_servers_with_its_grade_cache(monkeypatch, tmp_path, n, flags):
    seen: dict = {}

    class Servers:  # stands in for the launcher: what the run asks it for is the point here
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)

        def __enter__(self):
            return ["http://127.0.0.1:1"], "token"

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(side, "LocalEnvServers", Servers)
    cfg = load_config(CONFIG, [f"rl.env_grade_cache={n}"])

    async def start():
        async with contextlib.AsyncExitStack() as stack:
            return await side._env_servers(stack, cfg, tmp_path, lambda line: None)

    urls, token, _ = asyncio.run(start())
    assert urls == ["http://127.0.0.1:1"] and seen["extra_args"] == flags
