"""A step survives the loss of an environment server: the rollouts whose server dies mid-rollout
are redone on the other server, scored and trained on; none is lost or scored 0."""

from __future__ import annotations

import pytest
from support.bwrap import needs_bwrap
from support.live_env import REPO

from composer_jax.config import load_config
from composer_jax.env.api import client as env_client
from composer_jax.rl.learner import run_rl
from composer_jax.rl.rollout.env_servers import LocalEnvServers

TOKEN = "rl-learner-fault-token-0123456789"
pytestmark = needs_bwrap


# full suite only (~35 s under load): the default suite keeps the redo of a rollout whose server died
# in tests/rl/rollout/test_agent.py::test_dead_server_restarts_the_rollout_elsewhere and a run that
# survives a killed environment server in tests/rl/test_learner_supervision.py
@pytest.mark.slow
def test_step_completes_when_a_server_dies_mid_rollout(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    tasks = REPO / "tests" / "rl" / "fixtures" / "tasks"
    victim = LocalEnvServers(tasks, token=TOKEN)
    grade = env_client.RemoteSession.grade
    lost: list[str] = []

    async def grade_unless_dead(self):
        # the first rollout to finish on the victim finds it dead when it asks for its grade
        if self.server_url in victim.urls and not lost:
            lost.append(self.session_id)
            victim.stop()
        return await grade(self)

    monkeypatch.setattr(env_client.RemoteSession, "grade", grade_unless_dead)
    with LocalEnvServers(tasks, token=TOKEN) as (healthy, _), victim as (dead, _):
        overrides = [
            f"train.out_dir={tmp_path}",
            "train.steps=1",
            "rl.eval_tasks=[]",
            f"rl.env_urls=[{dead[0]}, {healthy[0]}]",
            f"rl.env_token={TOKEN}",
        ]
        cfg = load_config("tests/rl/fixtures/rl_pick.yaml", overrides)
        summary = run_rl(cfg, echo=lambda _: None)
    step = summary["steps"][1]
    assert lost, "no rollout ran on the victim server"
    # every rollout of both groups was scored (the lost ones redone on the healthy server)
    assert step["rollout/groups"] == 2.0 and step["rollout/env_failures"] == 0.0
    assert step["rollout/env_retries"] >= 1.0
    assert step["policy_tokens"] > 0  # and the step trained on them
