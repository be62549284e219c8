"""Evaluation against the real environment server: per-task and per-category metrics worked out
from which samples were scripted to succeed, and the trajectory / predictions files."""

from __future__ import annotations

import asyncio
import json

from support.bwrap import needs_bwrap
from support.live_env import ENV_FIXTURE_TASKS, REPO
from support.scripted import ScriptedPolicy, call

from composer_jax.config.agent import AgentConfig
from composer_jax.env.api.client import EnvClient
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.rl.evaluate import report, write_outputs
from composer_jax.rl.rollout.agent import turn_seed
from composer_jax.rl.rollout.env_servers import LocalEnvServers
from composer_jax.rl.rollout.tasks import TaskRef, sample_tasks
from composer_jax.rl.samplers.policy import PolicyPool, SamplerUnavailable

FIX = call("edit_file", path="calc.py", old_string="return a - b", new_string="return a + b")
HELLO = call("edit_file", path="hello.txt", new_string="hello, world\n")


class Decides(ScriptedPolicy):
    """First turn: the fix when the turn's seed is even, a harmless look otherwise; then answer."""

    def next_text(self, gen, req):
        if any(m["role"] == "tool" for m in gen.messages):
            return "Done."
        task = gen.messages[1]["content"]
        if req.seed % 2:
            return call("list_dir", path=".")
        return HELLO if "hello.txt" in task else FIX


class DiesAfter(Decides):
    """Decides for `turns` turns, then every call fails as a dead sampler's would."""

    def __init__(self, tok, turns: int):
        super().__init__([], tok)
        self.left = turns

    async def turn(self, gen, req):
        self.left -= 1
        if self.left < 0:
            raise SamplerUnavailable("sampler replica died")
        return await super().turn(gen, req)


@needs_bwrap
def test_eval_metrics_and_files(tmp_path):
    tok = load_tokenizer(REPO / "assets" / "tokenizer")
    tasks = [TaskRef("fix-add", category="debugging"), TaskRef("write-hello", category="files")]
    samples, seed = 4, 3

    async def go(urls, token, policy):
        async with EnvClient(urls, token) as client:
            return await sample_tasks(policy, client, tasks, samples, AgentConfig(), seed=seed)

    # the evaluation spreads rollouts over every sampler: one that dies costs only its rollouts in
    # flight, redone on the other, and the metrics are those of one sampler alone
    dying, other = DiesAfter(tok, 3), Decides([], tok)
    with LocalEnvServers(ENV_FIXTURE_TASKS) as (urls, token):
        results = asyncio.run(go(urls, token, Decides([], tok)))
        pooled = asyncio.run(go(urls, token, PolicyPool([dying, other])))
    assert dying.left < 0 and len(dying.requests) == 3 and len(other.requests) > 3
    assert report(pooled) == report(results)
    # which samples succeed: their first turn's seed is even; the rollout seeds are seed*1000003+j for
    # the j-th (task, sample) pair, so sample i of one task does not share its draws with another's
    wins = [[turn_seed(seed * 1_000_003 + k * samples + i, 0, 0) % 2 == 0 for i in range(samples)] for k in range(2)]
    assert all(0 < sum(w) < samples for w in wins) and wins[0] != wins[1]  # this seed gives a mix (else pick another)
    rollout_seeds = [r.seed for task in tasks for r in results[task]]
    assert rollout_seeds == [seed * 1_000_003 + j for j in range(2 * samples)]
    rep = report(results)
    for task, w in zip(tasks, wins):
        m = rep["tasks"][task.name]
        assert m["pass@1"] == sum(w) / samples and m["best_of_k"] == 1.0
        assert m["turns"] == 2.0 and m["tool_calls"] == 1.0 and m["env_failures"] == 0.0
        assert [r.env_reward for r in results[task]] == [float(x) for x in w]
    assert set(rep["categories"]) == {"debugging", "files"}
    assert rep["overall"]["pass@1"] == (sum(wins[0]) + sum(wins[1])) / (2 * samples) and rep["overall"]["tasks"] == 2.0

    paths = write_outputs(results, tmp_path / "eval", "scripted")
    lines = [json.loads(x) for x in paths["trajectories"].read_text().splitlines()]
    assert len(lines) == 2 * samples and lines[0]["instance_id"] == "fix-add" and lines[0]["sample"] == 0
    assert lines[0]["generations"][0][0]["role"] == "system"
    preds = {p["instance_id"]: p for p in map(json.loads, paths["predictions"].read_text().splitlines())}
    assert set(preds) == {"fix-add", "write-hello"} and preds["fix-add"]["model_name_or_path"] == "scripted"
    # the submission is sample 0's diff whatever it scored; the oracle file holds the first that passed
    oracle = {p["instance_id"]: p for p in map(json.loads, paths["oracle"].read_text().splitlines())}
    fix = "-    return a - b\n+    return a + b\n"
    assert (fix in preds["fix-add"]["model_patch"]) == wins[0][0]
    assert fix in oracle["fix-add"]["model_patch"]
    assert json.loads(paths["report"].read_text())["overall"]["pass@1"] == rep["overall"]["pass@1"]
