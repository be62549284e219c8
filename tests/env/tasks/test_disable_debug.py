"""The RL demo's family disable-debug: its task text, its grader (the reference edit scores 1, an
untouched workspace, a falsy non-bool or another constant changed score 0), and its SFT
conversations replayed call by call on a live environment server serving the generated task (each
tool message equals the server's result, and the replayed edits pass the hidden tests)."""

from __future__ import annotations

import json
import re

import pytest
from support import harbor_oracle
from support.family_replay import replay_sft_conversation, sandboxed

from composer_jax.env.tasks.families import generate_task
from composer_jax.env.tasks.families.disable_debug import INSTRUCTIONS, OTHERS


def constants(text: str) -> dict[str, str]:
    return dict(re.findall(r"^(\w+) = (\S+)$", text, flags=re.M))


def test_tasks_ask_for_debug_off_among_seed_dependent_settings(tmp_path):
    wordings, layouts, positions = set(), set(), set()
    for seed in range(40):
        root = generate_task("disable-debug", seed, tmp_path)
        instruction = (root / "instruction.md").read_text()
        assert instruction.endswith("\n") and instruction[:-1] in INSTRUCTIONS
        text = (root / "environment" / "app" / "settings.py").read_text()
        old = constants(text)
        assert old["DEBUG"] == "True" and len(old) == 4 and set(old) - {"DEBUG"} <= set(OTHERS)
        assert all(1 <= int(v) <= 99 for n, v in old.items() if n != "DEBUG")
        # the reference changes exactly DEBUG's line
        solution = (root / "solution" / "app" / "settings.py").read_text()
        assert text.count("DEBUG = True\n") == 1
        assert solution == text.replace("DEBUG = True\n", "DEBUG = False\n")
        wordings.add(instruction)
        layouts.add(tuple(old))
        positions.add(list(old).index("DEBUG"))
    assert wordings == {w + "\n" for w in INSTRUCTIONS} and len(layouts) >= 20 and positions == {0, 1, 2, 3}


@sandboxed
def test_grader_reference_one_wrong_edits_zero(tmp_path):
    root = generate_task("disable-debug", 5, tmp_path / "t")
    app = root / "environment" / "app" / "settings.py"
    assert harbor_oracle.run_task(root, oracle=True).reward == 1.0
    assert harbor_oracle.run_task(root, oracle=False).reward == 0.0
    original = app.read_text()
    other, value = next((n, v) for n, v in constants(original).items() if n != "DEBUG")
    off = original.replace("DEBUG = True\n", "DEBUG = False\n")
    wrong = {
        "zero, not False": original.replace("DEBUG = True\n", "DEBUG = 0\n"),
        "a string": original.replace("DEBUG = True\n", "DEBUG = 'False'\n"),
        "DEBUG deleted": original.replace("DEBUG = True\n", ""),
        "another constant changed too": off.replace(f"{other} = {value}\n", f"{other} = {int(value) % 99 + 1}\n"),
    }
    for why, text in wrong.items():
        assert text != original, why
        app.write_text(text)
        assert harbor_oracle.run_task(root, oracle=False).reward == 0.0, why
    app.write_text(off)
    assert harbor_oracle.run_task(root, oracle=False).reward == 1.0  # the same edit made by hand


@sandboxed
@pytest.mark.parametrize("seed", [0, 1_000_003])
def test_family_sft_conversation_replays_on_the_server(http, seed, tmp_path):
    """`http`: a client of the live server of tests/env/conftest.py (it serves every family)."""
    edits = replay_sft_conversation(http, "disable-debug", seed, tmp_path)
    assert [e["name"] for e in edits] == ["list_dir", "read_file", "edit_file"]
    assert json.loads(edits[2]["arguments"])["old_string"] == "DEBUG = True\n"
