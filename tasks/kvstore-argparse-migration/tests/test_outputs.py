import json
import pathlib
import subprocess
import sys


def kv(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "kvstore", "--db", str(tmp_path / "db.jsonl"), *args], cwd="/app",
                          capture_output=True, text=True, timeout=20)


def test_round_trip(tmp_path):
    assert kv(tmp_path, "set", "user:1", "ann").returncode == 0
    kv(tmp_path, "set", "user:2", "bob")
    kv(tmp_path, "set", "cfg", "x y")
    r = kv(tmp_path, "get", "cfg")
    assert r.returncode == 0 and r.stdout == "x y\n"
    assert kv(tmp_path, "keys").stdout.splitlines() == ["cfg", "user:1", "user:2"]
    assert json.loads(kv(tmp_path, "keys", "--prefix", "user:", "--json").stdout) == ["user:1", "user:2"]
    assert kv(tmp_path, "del", "cfg").returncode == 0
    assert kv(tmp_path, "del", "cfg").returncode == 1
    r = kv(tmp_path, "get", "cfg")
    assert r.returncode == 1 and "not found" in r.stderr


def test_usage_errors_exit_2(tmp_path):
    for args in ([], ["get"], ["set", "a"], ["frob"], ["get", "--prefix", "x", "k"], ["keys", "extra"]):
        assert kv(tmp_path, *args).returncode == 2, args


def test_version_and_help(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvstore", "--version"], cwd="/app", capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "kvstore 1.3.0"
    r = subprocess.run([sys.executable, "-m", "kvstore", "keys", "--help"], cwd="/app", capture_output=True, text=True)
    assert "--prefix" in r.stdout and "--json" in r.stdout
    r = subprocess.run([sys.executable, "-m", "kvstore", "--help"], cwd="/app", capture_output=True, text=True)
    for cmd in ("get", "set", "del", "keys"):
        assert cmd in r.stdout


def test_argparse_everywhere():
    for path in pathlib.Path("/app").rglob("*.py"):
        assert "optparse" not in path.read_text(), path
    src = pathlib.Path("/app/kvstore/cli.py").read_text()
    assert "add_subparsers" in src
    readme = pathlib.Path("/app/README.md").read_text()
    assert "keys [--prefix P] [--json]" in readme and "--version" in readme
