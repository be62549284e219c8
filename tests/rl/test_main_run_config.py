"""The main RL run's pieces fit together: configs/rl/tiny_disable_debug.yaml is valid for the
learner; the reference trajectory of its family fits the agent's budgets and the RL row length;
the stage-3 SFT data holds the family's conversations whole in a row, is what `data make-sft
--family` writes, and never uses a seed the RL run trains or is evaluated on."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from composer_jax.cli import main as cli_main
from composer_jax.config import load_config
from composer_jax.data.cli import main as data_main
from composer_jax.env.cli import env_main
from composer_jax.env.tasks.families import FAMILIES
from composer_jax.formats.chatml import render_chat
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.rl.learner import check_config

REPO = Path(__file__).resolve().parents[2]
RL_CONFIG = REPO / "configs" / "rl" / "tiny_disable_debug.yaml"
SFT_CONFIG = REPO / "configs" / "pretrain" / "tiny_stage3_sft.yaml"
FAMILY_SFT = REPO / "assets" / "sft" / "disable_debug.jsonl"


@pytest.fixture(scope="module")
def conversations():
    return [json.loads(line) for line in FAMILY_SFT.read_text().splitlines()]


def test_rl_config_loads_and_names_the_family(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config(RL_CONFIG)
    check_config(cfg)
    assert cfg.rl.tasks == ("gen/disable-debug",) and cfg.rl.eval_tasks == ("gen/disable-debug",)
    assert "disable-debug" in FAMILIES and cfg.agent.context_budget == 0
    assert cfg.train.init_from == "runs/tiny/stage3/checkpoints"
    # the RL model is the SFT stage's (same architecture and tokenizer)
    assert cfg.model == load_config(SFT_CONFIG).model and cfg.data.tokenizer == "assets/tokenizer"
    # the policy is the tempered distribution: the trainer's log-probabilities are of what the agent samples
    assert cfg.agent.temperature == cfg.rl.loss.temperature
    # the start is set by the temperature on a saturated SFT stage: its lr schedule runs to its end
    sft = load_config(SFT_CONFIG)
    assert sft.train.steps >= 320 and sft.train.optimizer.schedule == "warmup_cosine"


def test_reference_trajectory_fits_the_agent_budgets(monkeypatch, conversations):
    monkeypatch.chdir(REPO)
    cfg = load_config(RL_CONFIG)
    tok = load_tokenizer(REPO / cfg.data.tokenizer)
    for conv in conversations[:16]:
        messages = conv["messages"]
        ids, mask = render_chat(messages, tok)
        assistant = [m for m in messages if m["role"] == "assistant"]
        assert len(ids) < cfg.train.seq_len - cfg.agent.max_turn_tokens // 2, len(ids)
        assert len(assistant) <= cfg.agent.max_turns
        assert int(mask.sum()) <= cfg.agent.max_rollout_tokens
        # each assistant turn (its content, calls and <|im_end|>): the mask's runs of ones
        runs = np.diff(np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]]))))[::2]
        assert len(runs) == len(assistant) and runs.max() <= cfg.agent.max_turn_tokens, runs


def test_sft_data_is_the_family_replayed_on_seeds_apart_from_rl(conversations, tmp_path):
    sft = load_config(SFT_CONFIG)
    rl = load_config(RL_CONFIG)
    assert any(s.path == "assets/sft/disable_debug.jsonl" for s in sft.data.sources)
    seeds = sorted(int(c["task"].rsplit("-", 1)[1]) for c in conversations)
    assert seeds == list(range(len(seeds))) and len(seeds) >= 128
    trained = range(rl.rl.task_seed, rl.rl.task_seed + rl.train.steps * rl.rl.groups_per_step * 4)
    evaluated = range(rl.rl.eval_seed, rl.rl.eval_seed + rl.rl.eval_seeds)
    assert not set(seeds) & set(trained) and not set(seeds) & set(evaluated) and not set(trained) & set(evaluated)
    # the file is what `composer-jax env generate disable-debug --seeds 0:256 --out DIR` and
    # `composer-jax data make-sft --tasks DIR` write (checked on a few seeds: natural seed order)
    assert env_main(["generate", "disable-debug", "--seeds", "8:12", "--out", str(tmp_path / "t")]) == 0
    assert data_main(["make-sft", "--tasks", str(tmp_path / "t"), "--out", str(tmp_path / "s.jsonl")]) == 0
    made = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert made == conversations[8:12]
    tok = load_tokenizer(REPO / "assets" / "tokenizer")
    assert max(len(render_chat(c["messages"], tok)[0]) for c in conversations) <= sft.train.seq_len


def test_env_generate_seed_specs(tmp_path, capsys):
    assert env_main(["generate", "set-constant", "--seeds", "3", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"set-constant-{i}" for i in range(3)]
    for bad in ("x", "5:5", "-1:3", "3:1"):
        assert cli_main(["env", "generate", "set-constant", f"--seeds={bad}", "--out", str(tmp_path)]) == 2
        assert f"--seeds {bad!r}: expected N" in capsys.readouterr().err
    assert cli_main(["env", "generate", "nope", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown family 'nope'; accepted:" in err and "set-constant" in err
