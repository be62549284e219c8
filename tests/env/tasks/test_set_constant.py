"""The first main-run family set-constant (docs/rl.md, "The main run"): its task text, its grader
(the reference edit scores 1, a wrong value or a second changed constant 0), and its SFT
conversations replayed call by call on a live environment server serving the generated task (each
tool message equals the server's result, and the replayed edits pass the hidden tests)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support import harbor_oracle
from support.family_replay import replay_sft_conversation, sandboxed

from composer_jax.env.tasks.families import generate_task
from composer_jax.env.tasks.families.set_constant import NAMES, VALUES


def parse(root: Path) -> tuple[str, int, dict[str, int]]:
    """(target, new value, the workspace's constants) read back from the generated files."""
    m = re.fullmatch(r"Set (\w+) to (\d+) in settings\.py\.\n", (root / "instruction.md").read_text())
    assert m, (root / "instruction.md").read_text()
    text = (root / "environment" / "app" / "settings.py").read_text()
    values = {n: int(v) for n, v in re.findall(r"^(\w+) = (\d+)$", text, flags=re.M)}
    return m.group(1), int(m.group(2)), values


def test_tasks_name_one_constant_and_a_new_value(tmp_path):
    targets, values = set(), set()
    for seed in range(40):
        root = generate_task("set-constant", seed, tmp_path)
        target, new, old = parse(root)
        assert sorted(old) == sorted(NAMES) and target in NAMES and new in VALUES and new != old[target]
        solution = (root / "solution" / "app" / "settings.py").read_text()
        # the reference changes exactly the target's line
        assert solution == (root / "environment" / "app" / "settings.py").read_text().replace(
            f"{target} = {old[target]}\n", f"{target} = {new}\n"
        )
        targets.add(target)
        values.add(new)
    assert targets == set(NAMES) and values == set(VALUES)


@sandboxed
def test_grader_reference_one_wrong_edits_zero(tmp_path):
    root = generate_task("set-constant", 5, tmp_path / "t")
    target, new, old = parse(root)
    app = root / "environment" / "app" / "settings.py"
    assert harbor_oracle.run_task(root, oracle=True).reward == 1.0
    assert harbor_oracle.run_task(root, oracle=False).reward == 0.0
    original = app.read_text()
    other = next(n for n in NAMES if n != target)
    wrong = {
        "wrong value": original.replace(
            f"{target} = {old[target]}\n", f"{target} = {VALUES[(VALUES.index(new) + 1) % len(VALUES)]}\n"
        ),
        "the right value on another constant": original.replace(f"{other} = {old[other]}\n", f"{other} = {new}\n"),
        "another constant changed too": original.replace(f"{target} = {old[target]}\n", f"{target} = {new}\n").replace(
            f"{other} = {old[other]}\n", f"{other} = {old[other] % 9 + 1}\n"
        ),
        "a string value": original.replace(f"{target} = {old[target]}\n", f"{target} = '{new}'\n"),
    }
    for why, text in wrong.items():
        assert text != original, why
        app.write_text(text)
        assert harbor_oracle.run_task(root, oracle=False).reward == 0.0, why
    app.write_text(original.replace(f"{target} = {old[target]}\n", f"{target} = {new}\n"))
    assert harbor_oracle.run_task(root, oracle=False).reward == 1.0  # the same edit made by hand


@sandboxed
@pytest.mark.parametrize("seed", [0, 1_000_003])
def test_family_sft_conversation_replays_on_the_server(http, seed, tmp_path):
    """`http`: a client of the live server of tests/env/conftest.py (it serves every family)."""
    edits = replay_sft_conversation(http, "set-constant", seed, tmp_path)
    assert [e["name"] for e in edits] == ["list_dir", "read_file", "edit_file"]
