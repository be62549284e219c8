"""Family disable-debug: turn off the DEBUG flag in settings.py, leaving the other settings alone.

The RL demo's family, sized for the tiny model: "Disable DEBUG in settings.py." (one of eight
wordings) on a one-file workspace that holds ``DEBUG = True`` among three other integer constants.
The wording, the other constants' names (three of a pool of eight), their values and the position
of DEBUG among them depend on the seed; the change asked for does not. Solving it takes the agent's
usual moves (look, read, one search/replace of ``DEBUG = True``, summarise) carried out without a
broken tool call, which a model fine-tuned on some seeds can learn to do reliably on every seed:
what varies between seeds is what it reads, not what it must write. (Its sibling set-constant asks
for a seed-dependent name and value copied from the instruction, which the tiny model does not
learn to copy.)

The hidden tests import the module and check every constant: DEBUG is False (the bool, not 0 or a
string) and the others are unchanged.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from .base import Family, TaskSpec

FAMILY = Family("disable-debug", "Turn off DEBUG in settings.py, keeping the other settings.", "config")

# The constants a workspace may hold besides DEBUG (three of them per seed, each a small int).
OTHERS = ("RETRIES", "WORKERS", "TIMEOUT", "BATCH", "PORT", "CACHE_SIZE", "MAX_ITEMS", "INTERVAL")
# The request, worded per seed (the change is the same whatever the wording)
INSTRUCTIONS = (
    "Disable DEBUG in settings.py.",
    "Turn off DEBUG in settings.py.",
    "Set DEBUG to False in settings.py.",
    "Switch DEBUG off in settings.py.",
    "DEBUG should be off: fix settings.py.",
    "Turn DEBUG off in settings.py.",
    "Disable the DEBUG flag in settings.py.",
    "Make DEBUG False in settings.py.",
)

_TESTS = """\
import importlib


def test_settings():
    settings = importlib.import_module("settings")
    assert settings.DEBUG is False, settings.DEBUG
    expected = {expected!r}
    for name, value in expected.items():
        assert getattr(settings, name, None) == value, (name, getattr(settings, name, None), value)
"""


def _module(values: Mapping[str, object]) -> str:
    lines = ['"""Service settings."""', ""] + [f"{n} = {v}" for n, v in values.items()]
    return "\n".join(lines) + "\n"


def generate(rng: random.Random, seed: int) -> TaskSpec:
    instruction = INSTRUCTIONS[seed % len(INSTRUCTIONS)]  # every wording within any 8 consecutive seeds
    names = rng.sample(OTHERS, 3)
    others = {n: rng.randint(1, 99) for n in names}
    order = list(others)
    order.insert(rng.randrange(len(order) + 1), "DEBUG")
    old = {n: (True if n == "DEBUG" else others[n]) for n in order}
    new = {**old, "DEBUG": False}
    return TaskSpec(
        instruction=instruction,
        app={"settings.py": _module(old)},
        tests={"test_outputs.py": _TESTS.format(expected=others)},
        solution={"settings.py": _module(new)},
        difficulty="easy",
        category="config",
        tags=["python", "config", "disable-debug"],
    )
