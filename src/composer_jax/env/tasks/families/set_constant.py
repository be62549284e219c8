"""Family set-constant: change one setting in settings.py to the value the instruction names.

The RL demo's family, sized for the tiny model: the workspace is one short module of constants, the
instruction names one of them and its new value (a small integer drawn from the seed), and the
reference change is one search/replace of that line. Solving it takes the agent's usual moves (look,
read, edit, summarise) and copying: the constant's name and new value from the instruction, its
old line from the file. Nothing else is seed-dependent, so a model fine-tuned on some seeds can
carry the moves over to held-out seeds and succeeds exactly when it copies the right values.

The hidden tests import the module and check every constant: the target has the new value and
the others are unchanged.
"""

from __future__ import annotations

import random

from .base import Family, TaskSpec

FAMILY = Family("set-constant", "Set one constant of settings.py to a given value.", "config")

# The constants every workspace holds (in a seed-dependent order), with their starting values.
DEFAULTS = {"RETRIES": 3, "WORKERS": 4, "TIMEOUT": 30, "BATCH": 16}
NAMES = tuple(DEFAULTS)
# The values an instruction may ask for (none is a default, so the change is never a no-op).
VALUES = (2, 5, 8)

_TESTS = """\
import importlib


def test_settings():
    settings = importlib.import_module("settings")
    expected = {expected!r}
    for name, value in expected.items():
        assert getattr(settings, name, None) == value, (name, getattr(settings, name, None), value)
"""


def _module(values: dict[str, int]) -> str:
    lines = ['"""Worker settings."""', ""] + [f"{n} = {v}" for n, v in values.items()]
    return "\n".join(lines) + "\n"


def generate(rng: random.Random, seed: int) -> TaskSpec:
    order = list(NAMES)
    rng.shuffle(order)
    target = rng.choice(NAMES)
    old = {n: DEFAULTS[n] for n in order}
    new_value = rng.choice(VALUES)
    new = {**old, target: new_value}
    return TaskSpec(
        instruction=f"Set {target} to {new_value} in settings.py.",
        app={"settings.py": _module(old)},
        tests={"test_outputs.py": _TESTS.format(expected=new)},
        solution={"settings.py": _module(new)},
        difficulty="easy",
        category="config",
        tags=["python", "config", "set-constant", target.lower()],
    )
