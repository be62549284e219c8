"""The learner learns: on the one-choice task served by the real environment server, RL raises
the success of a policy that starts at chance to near 1, and the same run with the advantage's
sign flipped does not.

The starting policy is the tiny model after a short SFT on both answers (learnable.py), so it
makes a well-formed tool call and picks red or blue with about even odds; only blue scores."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from support.bwrap import needs_bwrap
from support.learnable import SYSTEM, TASKS, sft_params, tiny_config
from support.live_env import REPO

from composer_jax.config import config_from_dict, to_dict
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.rl.algo import batch as rl_batch
from composer_jax.rl.learner import run_rl
from composer_jax.sharding import make_mesh

pytestmark = needs_bwrap

STEPS = 16


@pytest.fixture(scope="module")
def start():
    tok = load_tokenizer(REPO / "assets" / "tokenizer")
    sft = tiny_config(tok.vocab_size, seq_len=136)
    mesh = make_mesh(sft.mesh, jax.devices()[:1])
    params, loss = sft_params(sft, tok, steps=300, mesh=mesh)
    assert loss < 0.05, loss  # the format is learnt (both colours stay ~equally likely)
    return tok, sft, mesh, jax.device_get(params)


def rl_config(sft, out_dir):
    tree = to_dict(sft)
    tree["train"].update(
        steps=STEPS, batch_size=16, seq_len=192, out_dir=str(out_dir), log_every=1, tensorboard=False,
        optimizer={"lr": 0.001, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.0},
    )  # fmt: skip
    tree["data"] = {"tokenizer": str(REPO / "assets" / "tokenizer")}
    tree["agent"] = {"max_turns": 1, "max_turn_tokens": 40, "context_budget": 0, "system_prompt": SYSTEM}
    tree["rl"] = {
        "tasks": ["pick-colour"],
        "tasks_dir": str(TASKS),
        "group_size": 8,
        "groups_per_step": 2,
        "sampler": {"slots": 16},
    }
    return config_from_dict(tree)


def success_curve(summary) -> list[float]:
    return [summary["steps"][n]["rollout/success"] for n in sorted(summary["steps"])]


# slow: 92 s + 69 s of fixture on 2 cores, the suite's heaviest; `make test-all` runs it
@pytest.mark.slow
def test_rl_raises_success_from_chance_and_flipped_sign_does_not(start, tmp_path, monkeypatch):
    tok, sft, mesh, params = start
    learnt = success_curve(run_rl(rl_config(sft, tmp_path / "up"), mesh=mesh, init_params=params, echo=lambda _: None))
    assert 0.2 <= learnt[0] <= 0.8, learnt  # chance at the start: both colours are sampled
    assert np.mean(learnt[-4:]) >= 0.8 and np.mean(learnt[-4:]) >= learnt[0] + 0.2, learnt

    estimate = rl_batch.estimate_advantages
    monkeypatch.setattr(rl_batch, "estimate_advantages", lambda *a, **k: -estimate(*a, **k))
    flipped = success_curve(
        run_rl(rl_config(sft, tmp_path / "down"), mesh=mesh, init_params=params, echo=lambda _: None)
    )
    assert np.mean(flipped[-4:]) <= 0.35, flipped
    print("success per step, learnt:", learnt, "flipped:", flipped)  # shown with pytest -s
