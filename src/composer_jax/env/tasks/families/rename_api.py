"""Family rename-api: rename a function across a small package, with or without a shim.

The workspace ``shopcore`` has a ``pricing`` module and four caller modules; 2-4 of them use the
function to be renamed, each in one of three styles (``from .pricing import f``, ``pricing.f``,
``from .pricing import f as _price_fn``), and the others use a different pricing function and must
be left alone. The seed also decides whether the old name survives as a deprecated alias that warns,
or disappears entirely.
"""

from __future__ import annotations

import random
from typing import TypedDict

from .base import Family, TaskSpec, run_source

FAMILY = Family(
    "rename-api", "Rename a pricing function across a package, with or without a deprecated alias.", "refactor"
)


class _Target(TypedDict):
    new: list[str]  # candidate new names
    src: str  # function source, formatted with name=
    use: str  # call expression used by a caller, formatted with ref=
    check: tuple[str, int | str]  # (call arguments, expected result)


_TARGETS: dict[str, _Target] = {
    "calc_total": {
        "new": ["compute_total", "order_total", "sum_lines"],
        "src": (
            "def {name}(lines):\n"
            '    """Total in cents of (qty, unit_cents) lines."""\n'
            "    return sum(qty * unit for qty, unit in lines)\n"
        ),
        "use": "{ref}(lines)",
        "check": ("[(2, 150), (1, 999), (3, 5)]", 2 * 150 + 999 + 15),
    },
    "apply_discount": {
        "new": ["discounted", "with_discount", "reduce_by_percent"],
        "src": (
            "def {name}(cents, percent):\n"
            '    """Cents after a percentage discount, rounded half up."""\n'
            "    return (cents * (100 - percent) + 50) // 100\n"
        ),
        "use": "{ref}(sum(q * u for q, u in lines), 10)",
        "check": ("1999, 15", (1999 * 85 + 50) // 100),
    },
    "fmt_money": {
        "new": ["format_cents", "money_str", "render_amount"],
        "src": (
            "def {name}(cents):\n"
            '    """Render cents as a dollar string, e.g. 1234 -> \'$12.34\'."""\n'
            '    sign = "-" if cents < 0 else ""\n'
            "    cents = abs(cents)\n"
            '    return f"{{sign}}${{cents // 100:,}}.{{cents % 100:02d}}"\n'
        ),
        "use": "{ref}(sum(q * u for q, u in lines))",
        "check": ("-123456", "-$1,234.56"),
    },
}

_CALLERS = ["cart", "checkout", "invoice", "report"]

_TESTS = """\
import ast
import pathlib
import warnings

import pytest

OLD, NEW, KEEP_ALIAS = {old!r}, {new!r}, {keep!r}
CALLERS = {callers!r}
EXPECTED = {expected!r}
PKG = pathlib.Path("/app/shopcore")


def names_in(path):
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == OLD:
            found.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == OLD:
            found.append(node.lineno)
        elif isinstance(node, ast.alias) and (node.name == OLD or node.asname == OLD):
            found.append(getattr(node, "lineno", 0))
        elif isinstance(node, ast.FunctionDef) and node.name == OLD:
            found.append(node.lineno)
    return found


def test_new_name_works():
    from shopcore import pricing
    fn = getattr(pricing, NEW)
    assert fn({args}) == {check!r}


def test_callers_use_new_name():
    for path in sorted(PKG.glob("*.py")):
        if path.name == "pricing.py":
            continue
        assert names_in(path) == [], f"{{path.name}} still refers to {{OLD}}"
        if path.stem in CALLERS:
            src = path.read_text()
            assert NEW in src, f"{{path.name}} should call {{NEW}}"


def test_callers_behave_the_same():
    import importlib
    lines = [(2, 150), (1, 999), (3, 5), (4, 1250)]
    for mod in CALLERS:
        m = importlib.import_module(f"shopcore.{{mod}}")
        assert m.summarise(lines) == EXPECTED[mod], mod


def test_old_name_policy():
    from shopcore import pricing
    if KEEP_ALIAS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = getattr(pricing, OLD)({args})
        assert value == {check!r}
        assert any(issubclass(w.category, DeprecationWarning) and NEW in str(w.message) for w in caught), \\
            "calling the old name must emit a DeprecationWarning that mentions the new name"
    else:
        assert not hasattr(pricing, OLD)
        assert OLD not in (PKG / "pricing.py").read_text()


def test_new_name_does_not_warn():
    from shopcore import pricing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        getattr(pricing, NEW)({args})
"""


def generate(rng: random.Random, seed: int) -> TaskSpec:
    old = rng.choice(sorted(_TARGETS))
    t = _TARGETS[old]
    new = rng.choice(t["new"])
    keep = rng.random() < 0.5
    callers = sorted(rng.sample(_CALLERS, rng.randint(2, 4)))
    others = [o for o in sorted(_TARGETS) if o != old]

    def pricing(name: str, alias: bool) -> str:
        out = ['"""Pricing primitives (all amounts in integer cents)."""\n']
        if alias:
            out.append("import warnings\n")
        for fn in sorted(_TARGETS):
            out.append("\n\n" + _TARGETS[fn]["src"].format(name=name if fn == old else fn))
        if alias:
            out.append(
                f"\n\ndef {old}(*args, **kwargs):\n"
                f'    """Deprecated alias of {name}."""\n'
                f'    warnings.warn("{old} is deprecated; use {name}", DeprecationWarning, stacklevel=2)\n'
                f"    return {name}(*args, **kwargs)\n"
            )
        return "".join(out)

    def caller(mod: str, name: str, style: int) -> str:
        if style == 0:
            head = f"from .pricing import {name}\n"
            ref = name
        elif style == 1:
            head = "from . import pricing\n"
            ref = f"pricing.{name}"
        else:
            head = f"from .pricing import {name} as _price_fn\n"
            ref = "_price_fn"
        return (
            f'"""{mod.capitalize()} helpers."""\n{head}\n\n'
            f"def summarise(lines):\n"
            f'    """Summary value used by the {mod} view."""\n'
            f"    return {t['use'].format(ref=ref)}\n"
        )

    app = {
        "shopcore/__init__.py": '"""shopcore: the pricing side of the shop."""\n',
        "shopcore/pricing.py": pricing(old, False),
    }
    sol = {"shopcore/pricing.py": pricing(new, keep)}
    env = run_source(pricing(old, False), "<p>")
    sample = [(2, 150), (1, 999), (3, 5), (4, 1250)]
    expected = {}
    for mod in _CALLERS:
        if mod in callers:
            style = rng.randrange(3)
            app[f"shopcore/{mod}.py"] = caller(mod, old, style)
            sol[f"shopcore/{mod}.py"] = caller(mod, new, style)
            expected[mod] = eval(t["use"].format(ref=old), env, {"lines": sample})
        else:
            other = rng.choice(others)
            src = (
                f'"""{mod.capitalize()} helpers."""\nfrom . import pricing\n\n\n'
                f"def summarise(lines):\n    return {_TARGETS[other]['use'].format(ref='pricing.' + other)}\n"
            )
            app[f"shopcore/{mod}.py"] = src
            expected[mod] = eval(_TARGETS[other]["use"].format(ref=other), env, {"lines": sample})
    policy = (
        f"Keep `{old}` working as a deprecated alias that emits a `DeprecationWarning` pointing to `{new}`."
        if keep
        else f"Remove `{old}` entirely, no alias."
    )
    instr = rng.choice(
        [
            f"Rename `shopcore.pricing.{old}` to `{new}` and update every caller in the package. {policy}",
            f"`{old}` is a bad name. Rename it to `{new}` everywhere in shopcore. {policy}",
        ]
    )
    args, check = t["check"]
    tests = _TESTS.format(old=old, new=new, keep=keep, callers=callers, expected=expected, args=args, check=check)
    return TaskSpec(
        instruction=instr,
        app=app,
        tests={"test_outputs.py": tests},
        solution=sol,
        difficulty="easy" if not keep else "medium",
        category="refactor",
        tags=["python", "refactor", "rename", old],
    )
