import ast
import pathlib
import warnings

import pytest

from eventbus import EventBus, once
from eventbus.audit import AuditLog

OLD = {"subscribe": "on", "unsubscribe": "off", "publish": "emit"}


def test_new_api_no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bus, seen = EventBus(), []
        unsub = bus.on("t", seen.append)
        once(bus, "t", lambda p: seen.append(("once", p)))
        log = AuditLog(bus, ["t", "u"])
        assert bus.emit("t", 1) == 3
        assert bus.emit("u", 2) == 1
        unsub()
        bus.off("t", seen.append)
        assert bus.emit("t", 3) == 1
        assert seen == [1, ("once", 1)]
        assert log.entries == [("t", 1), ("u", 2), ("t", 3)]


@pytest.mark.parametrize("old,new", OLD.items())
def test_old_names_warn(old, new):
    bus, seen = EventBus(), []
    with pytest.warns(DeprecationWarning, match=new):
        if old == "subscribe":
            unsub = bus.subscribe("t", seen.append)
            assert callable(unsub)
        elif old == "publish":
            bus.on("t", seen.append)
            assert bus.publish("t", 5) == 1
            assert seen == [5]
        else:
            bus.on("t", seen.append)
            bus.unsubscribe("t", seen.append)
            assert bus.handler_count("t") == 0


def test_no_internal_use_of_old_names():
    for path in pathlib.Path("/app").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in OLD:
                pytest.fail(f"{path}: still calls .{node.func.attr}()")


def test_readme_documents_new_names():
    text = pathlib.Path("/app/README.md").read_text()
    for new in ("on(", "off(", "emit("):
        assert new in text
