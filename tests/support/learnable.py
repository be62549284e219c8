"""The trivially learnable environment of the RL learning test, and the policy it starts from.

The task (fixtures/tasks/pick-colour) asks for one colour, red or blue, in answer.txt; only blue
scores. The starting policy is the tiny model fine-tuned (with the library's own SFT step) on the
two answers equally often, so it makes a well-formed tool call and picks either colour with about
even odds: chance is 0.5, and learning means moving that one choice."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

import composer_jax as cj
from composer_jax.config import Config, config_from_dict
from composer_jax.env.api.protocol import edit_file_write_result
from composer_jax.formats.chatml import render_chat
from composer_jax.sharding import ShardingRules, make_mesh
from composer_jax.train.state import init_train_state
from composer_jax.train.step import make_train_step

TASKS = Path(__file__).resolve().parents[1] / "rl" / "fixtures" / "tasks"
SYSTEM = "Use the tools."
INSTRUCTION = (TASKS / "pick-colour" / "instruction.md").read_text()


def conversation(colour: str) -> list[dict]:
    args = {"path": "answer.txt", "new_string": colour}
    result = edit_file_write_result("/app/answer.txt", True, colour)
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": INSTRUCTION},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "edit_file", "arguments": json.dumps(args)}}],
        },
        {"role": "tool", "tool_call_id": "", "content": json.dumps(result)},
    ]


def tiny_config(vocab_size: int, **train) -> Config:
    model = dict(
        vocab_size=vocab_size, hidden_size=64, num_layers=2, num_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, num_shared_experts=1, first_k_dense=1, n_group=4, topk_group=2,
        num_mtp_layers=0, max_position_embeddings=512,
    )  # fmt: skip
    t = {"seq_len": 160, "batch_size": 8, "steps": 100, "optimizer": {"lr": 0.02, "warmup_steps": 5}, **train}
    return config_from_dict({"model": model, "mesh": {"fsdp": -1}, "train": t})


def sft_params(cfg: Config, tok, steps: int, seed: int = 0, mesh=None):
    """The tiny model trained on red and blue answers, 4 of each per batch."""
    rows = []
    for colour in ("red", "blue"):
        ids, mask = render_chat(conversation(colour), tok)
        assert len(ids) <= cfg.train.seq_len, len(ids)
        n, s = len(ids), cfg.train.seq_len
        row = {
            "tokens": np.full(s, tok.pad_id, np.int32),
            "segment_ids": np.zeros(s, np.int32),
            "positions": np.zeros(s, np.int32),
            "loss_mask": np.zeros(s, np.float32),
        }
        row["tokens"][:n], row["segment_ids"][:n], row["positions"][:n], row["loss_mask"][:n] = (
            ids,
            1,
            np.arange(n),
            mask,
        )
        rows.append(row)
    batch = {k: np.stack([rows[i % 2][k] for i in range(cfg.train.batch_size)]) for k in rows[0]}
    mesh, rules = mesh if mesh is not None else make_mesh(cfg.mesh), ShardingRules.create()
    state = init_train_state(cfg, mesh, rules, cj.init_params(cfg.model, jax.random.key(seed)))
    step = make_train_step(cfg, mesh, rules)
    with jax.set_mesh(mesh):
        for _ in range(steps):
            state, metrics = step(state, batch)
    return state.params, float(metrics["loss"])
