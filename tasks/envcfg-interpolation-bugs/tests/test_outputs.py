import pytest

from envcfg import load
from envcfg.interpolate import InterpolationError, interpolate


def lk(d):
    return d.get


def test_dotted_and_env(tmp_path):
    p = tmp_path / "a.ini"
    p.write_text("[db]\nhost = ${DB_HOST:-localhost}\nport = 5432\n[app]\ndsn = postgres://${db.host}:${db.port}/x\n")
    assert load(p, env={}).get("app.dsn") == "postgres://localhost:5432/x"
    assert load(p, env={"DB_HOST": "db1"}).get("app.dsn") == "postgres://db1:5432/x"


def test_cycles_raise_interpolation_error():
    with pytest.raises(InterpolationError):
        interpolate("${a}", lk({"a": "${a}"}))
    with pytest.raises(InterpolationError):
        interpolate("x ${a}", lk({"a": "${b}", "b": "${c}", "c": "${a}"}))


def test_nested_default():
    assert interpolate("${PORT:-${DEFAULT_PORT}}", lk({"DEFAULT_PORT": "8080"})) == "8080"
    assert interpolate("${PORT:-${DEFAULT_PORT:-80}}", lk({})) == "80"
    assert interpolate("<${PORT:-${DEFAULT_PORT:-80}}>", lk({"PORT": "1"})) == "<1>"
    assert interpolate("${A:-}", lk({})) == ""
    with pytest.raises(InterpolationError):
        interpolate("${A:-${B}}", lk({}))


def test_escaped_dollar():
    assert interpolate("$${HOME}", lk({"HOME": "/root"})) == "${HOME}"
    assert interpolate("cost: $$5 and ${X}", lk({"X": "$$"})) == "cost: $5 and $"
    assert interpolate("$HOME stays", lk({"HOME": "/x"})) == "$HOME stays"


def test_values_referencing_escapes_are_not_reexpanded():
    assert interpolate("${A}", lk({"A": "$${B}", "B": "no"})) == "${B}"


def test_deep_but_finite_chain():
    d = {f"k{i}": f"${{k{i + 1}}}" for i in range(8)}
    d["k8"] = "end"
    assert interpolate("${k0}", lk(d)) == "end"
