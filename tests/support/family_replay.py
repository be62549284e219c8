"""Shared by the generated families' tests: a family's SFT conversation replayed call by call on
the live environment server of tests/env/conftest.py."""

from __future__ import annotations

import json

import pytest

from composer_jax.data.sft import task_conversation
from composer_jax.env.tasks.families import generate_task
from support.bwrap import needs_bwrap


def sandboxed(test):
    return pytest.mark.sandbox(needs_bwrap(test))


def replay_sft_conversation(http, family: str, seed: int, tmp_path) -> list[dict]:
    """Replay `family`'s SFT conversation for `seed` on a session of the generated task: the user
    message is the server's instruction byte for byte, every tool message equals the server's result
    and the session grades 1. Returns the conversation's tool calls (`function` dicts) in order."""
    conv = task_conversation(generate_task(family, seed, tmp_path))
    messages = conv["messages"]
    assert conv["task"] == f"{family}-{seed}"
    expected = {m["tool_call_id"]: json.loads(m["content"]) for m in messages if m["role"] == "tool"}
    created = http.post("/sessions", json={"task_id": f"gen/{family}", "seed": seed}).json()
    sid = created["session_id"]
    try:
        assert messages[1]["content"] == created["instruction"]  # byte for byte what the agent is given
        for message in messages:
            calls = message.get("tool_calls") or []
            if not calls:
                continue
            body = {"calls": [{"id": c["id"], **c["function"]} for c in calls]}
            for call, result in zip(calls, http.post(f"/sessions/{sid}/tools", json=body).json()["results"]):
                assert result["ok"] and result["result"] == expected[call["id"]], call
        assert http.post(f"/sessions/{sid}/grade").json()["reward"] == 1.0
    finally:
        http.delete(f"/sessions/{sid}")
    return [c["function"] for m in messages for c in m.get("tool_calls") or []]
