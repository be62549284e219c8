"""Per-task Python environments (env/pyenv.py): the [environment] spec, sandboxed builds from a
wheelhouse made here (no network), the cache, grading and sessions with the env on PATH, and a
malicious setup.py that tries to read host files and write outside its cache entry."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.bwrap import needs_bwrap, require_bwrap
from support.live_server import LiveServer
from support.metrics_scrape import parse
from support.sdists import sdist_bytes

from composer_jax.cli import main as cli_main
from composer_jax.env.api.errors import TaskError
from composer_jax.env.sandbox.pyenv import ENV_MOUNT, EnvBuildError, EnvCache, spec_key
from composer_jax.env.sandbox.runner import BubblewrapSandbox, Limits, SandboxCommand
from composer_jax.env.sandbox.spec import EnvSpec
from composer_jax.env.server.app import GradeResponse
from composer_jax.env.server.session import SessionManager
from composer_jax.env.tasks.envspec import parse_environment
from composer_jax.env.tasks.store import TaskStore, load_task, parse_task_config
from composer_jax.env.tasks.task_env import for_task
from composer_jax.env.tasks.validate import validate_all

REPO = Path(__file__).resolve().parents[3]


# ------------------------------------------------------------------ spec parsing
def test_spec_parsing(tmp_path):
    assert parse_environment({"cpus": 2}, tmp_path, "t") is None  # Harbor's own keys only: no env
    (tmp_path / "environment").mkdir()
    (tmp_path / "environment" / "req.txt").write_text("# pinned\nattrs==23.2.0\n\nidna  # for urls\n")
    spec = parse_environment(
        {"python": "3.11", "requirements": ["six"], "requirements_file": "environment/req.txt"}, tmp_path, "t"
    )
    assert spec == EnvSpec("3.11", ("six", "attrs==23.2.0", "idna"), "none")
    cfg = parse_task_config({"environment": {"requirements": ["six"], "install_app": "editable"}}, "t", tmp_path)
    assert cfg.environment == EnvSpec(None, ("six",), "editable")
    assert parse_task_config({}, "t", tmp_path).environment is None
    # the key changes with anything that changes the build
    a = EnvSpec(None, ("six",))
    assert spec_key(a, None, "wheelhouse:x") == spec_key(EnvSpec(None, ("six",)), None, "wheelhouse:x")
    assert (
        len({spec_key(a, None, "w1"), spec_key(a, None, "w2"), spec_key(EnvSpec(None, ("six==1",)), None, "w1")}) == 3
    )


@pytest.mark.parametrize(
    "table, fragment",
    [
        ({"python": 3.11}, 'python = 3.11 must be a version "3.N"'),
        ({"python": "py3"}, "python = 'py3'"),
        ({"requirements": "six"}, "requirements = 'six' must be a list of strings"),
        ({"requirements": ["-r other.txt"]}, "no pip options"),
        ({"requirements": ["--index-url http://evil"]}, "no pip options"),
        ({"requirements_file": "nope.txt"}, "requirements_file = 'nope.txt': no such file"),
        ({"requirements_file": "../../etc/passwd"}, "outside the task directory"),
        ({"install_app": "yes"}, "install_app = 'yes'; accepted: 'none', 'editable'"),
    ],
)
def test_spec_errors_name_the_key(tmp_path, table, fragment):
    with pytest.raises(TaskError, match="environment") as err:
        parse_environment(table, tmp_path, "task 'x' task.toml")
    assert fragment in str(err.value)


# ------------------------------------------------------------------ fixtures: wheelhouse, tasks
def _sdist(dest: Path, name: str, setup_py: str) -> None:
    """A minimal sdist (PKG-INFO + setup.py), written by hand: building one needs no network."""
    (dest / f"{name}-0.1.tar.gz").write_bytes(sdist_bytes(name, setup_py))


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wh")
    pkg = root / "src" / "tinypkg"
    (pkg / "tinypkg").mkdir(parents=True)
    (pkg / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "tinypkg"\nversion = "0.1"\n'
    )
    (pkg / "tinypkg" / "__init__.py").write_text("def answer():\n    return 42\n")
    wh = root / "wheelhouse"
    wh.mkdir()
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*cmd, str(pkg), "-w", str(wh)], check=True, capture_output=True, timeout=120)
    assert [p.name for p in wh.iterdir()] == ["tinypkg-0.1-py3-none-any.whl"]
    return wh


def _task(root: Path, requirements: list[str], *, install_app: str = "none") -> Path:
    """A task whose tests import tinypkg: the oracle makes /app/calc.py use it."""
    (root / "environment" / "app").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "solution").mkdir()
    env = {"requirements": requirements, "install_app": install_app}
    (root / "task.toml").write_text(
        'version = "1.0"\n[verifier]\ntimeout_sec = 60\n[environment]\n'
        + "".join(f"{k} = {json.dumps(v)}\n" for k, v in env.items())
    )
    (root / "instruction.md").write_text("Make calc.value() return tinypkg.answer().\n")
    (root / "environment" / "app" / "calc.py").write_text("def value():\n    return 0\n")
    (root / "tests" / "test_calc.py").write_text(
        "import tinypkg\nimport calc\n\ndef test_value():\n    assert calc.value() == tinypkg.answer() == 42\n"
    )
    (root / "tests" / "test.sh").write_text(
        "cd /app\nif python3 -m pytest -q -p no:cacheprovider /tests/test_calc.py; then echo 1 > "
        "/logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n"
    )
    (root / "solution" / "solve.sh").write_text(
        "cat > /app/calc.py <<'EOF'\nimport tinypkg\n\ndef value():\n    return tinypkg.answer()\nEOF\n"
    )
    return root


@pytest.fixture(scope="module")
def sandbox():
    require_bwrap()
    return BubblewrapSandbox()


@pytest.fixture(scope="module")
def built(tmp_path_factory, wheelhouse, sandbox):
    """(cache, tasks dir, built env, seconds the build took): one build shared by the tests."""
    tasks = tmp_path_factory.mktemp("tasks")
    task = load_task(_task(tasks / "uses-tinypkg", ["tinypkg"]))
    cache = EnvCache(tmp_path_factory.mktemp("envcache"), sandbox, wheelhouse=wheelhouse)
    t0 = time.monotonic()
    env = asyncio.run(for_task(cache, task))
    return cache, tasks, env, time.monotonic() - t0


# ------------------------------------------------------------------ builds, cache, grading


@pytest.mark.sandbox
def test_build_from_wheelhouse_is_cached_and_read_only(built, sandbox, wheelhouse):
    cache, tasks, env, seconds = built
    assert env is not None and env.python_version.startswith("3.")
    assert env.mount().dest == ENV_MOUNT and not env.mount().writable
    assert env.env_vars()["PATH"].startswith(f"{ENV_MOUNT}/bin:")
    # pytest: the toolchain's (the task declares none), the one that runs its tests
    want = {"key": env.key, "python": env.python_version, "requirements": ["tinypkg"], "pytest": pytest.__version__}
    assert env.describe() == want
    st = env.host_path.stat()
    assert (st.st_uid, st.st_mode & 0o222) == (os.geteuid(), 0)  # sealed: owned by us, no write bits
    task = load_task(tasks / "uses-tinypkg")

    async def again():
        a, b = await asyncio.gather(for_task(cache, task), for_task(cache, task))
        fresh = EnvCache(cache.root, sandbox, wheelhouse=wheelhouse)  # a restarted server: from disk
        return a, b, await for_task(fresh, task), fresh

    a, b, c, fresh = asyncio.run(again())
    assert a == b == env and c is not None and c.key == env.key and fresh.build_seconds == {}
    assert list(cache.build_seconds) == [env.key]  # built exactly once
    assert cache.builds == {"ok": 1} and fresh.builds == {}  # /metrics' cj_env_environment_builds_total
    assert cache.counts() == fresh.counts() == {"built": 1, "failed": 0}  # and cj_env_environments
    assert cache.lookup(task.config.environment, task.app_dir) == env


@pytest.mark.sandbox
def test_validate_oracle_and_untouched_with_the_env(built, sandbox):
    cache, tasks, env, _ = built
    store = TaskStore(tasks, tasks.parent / "gen-cache")
    reports = asyncio.run(validate_all(store, sandbox, env_cache=cache, limits=Limits(wall_seconds=120)))
    assert [(r.status, r.untouched_reward, r.oracle_reward) for r in reports] == [("pass", 0.0, 1.0)], reports
    # without the env the same task cannot import tinypkg: the oracle would score 0
    no_env = asyncio.run(validate_all(store, sandbox, env_cache=None, limits=Limits(wall_seconds=120)))
    assert no_env[0].status == "fail" and "no env cache" in no_env[0].detail


@pytest.mark.sandbox
def test_session_shell_and_grade_report_the_env(built, sandbox, tmp_path):
    cache, tasks, env, _ = built
    store = TaskStore(tasks, tmp_path / "gen")

    async def go():
        manager = SessionManager(store, sandbox, work_dir=tmp_path / "work", env_cache=cache)
        try:
            s = await manager.create("uses-tinypkg")
            r = await s.run_shell("command -v python3; python3 -c 'import tinypkg; print(tinypkg.answer())'", 30)
            w = await s.run_shell(f"touch {ENV_MOUNT}/x", 30)  # read-only for the agent
            g = await manager.grade(s.session_id)
            return r, w, g, parse(manager.metrics.render().decode())
        finally:
            await manager.shutdown()

    r, w, g, metrics = asyncio.run(go())
    assert metrics.types["cj_env_environments"] == "gauge"
    assert metrics("cj_env_environments", state="built") == 1 and metrics("cj_env_environments", state="failed") == 0
    assert metrics("cj_env_environment_builds_total", outcome="ok") == cache.builds["ok"] == 1
    assert r.exit_code == 0 and r.stdout.split() == [f"{ENV_MOUNT}/bin/python3", "42"], r
    assert w.exit_code != 0
    assert g.reward == 0.0 and g.environment == env.describe()
    assert g.interpreter["python"].startswith(f"{ENV_MOUNT}/"), g.interpreter  # the env's python3 ran
    assert GradeResponse(session_id="s", **g.to_dict()).environment["key"] == env.key


@pytest.mark.sandbox
def test_server_builds_at_startup_and_refuses_unbuilt(built, wheelhouse, tmp_path):
    cache, tasks, env, _ = built
    served = tmp_path / "tasks"
    shutil.copytree(tasks / "uses-tinypkg", served / "uses-tinypkg")  # same key: built by the fixture
    # A task whose build fails (no such package in the wheelhouse): served, its sessions refused.
    _task(served / "missing-dep", ["not-in-wheelhouse"])
    server = LiveServer("--env-cache", str(cache.root), "--wheelhouse", str(wheelhouse), tasks=served)
    try:
        with server.client() as http:
            sid = http.post("/sessions", json={"task_id": "uses-tinypkg"}).json()["session_id"]
            solve = "printf 'import tinypkg\\ndef value():\\n    return tinypkg.answer()\\n' > calc.py"
            call = {"name": "run_shell", "arguments": {"command": solve}}
            http.post(f"/sessions/{sid}/tools", json={"calls": [call]})
            graded = http.post(f"/sessions/{sid}/grade").json()
            refused = http.post("/sessions", json={"task_id": "missing-dep"})
    finally:
        server.stop()
    assert graded["reward"] == 1.0 and graded["environment"]["key"] == env.key, graded
    assert refused.status_code == 409 and "not-in-wheelhouse" in refused.text, refused.text


def test_unknown_python_is_a_clear_error(tmp_path):
    class FakeSandbox(BubblewrapSandbox):
        def __init__(self):  # no bwrap needed: interpreter() only looks at PATH
            self.path_env = str(tmp_path)

    with pytest.raises(EnvBuildError, match=r"python = '3.99': no python3.99 in the sandbox"):
        EnvCache(tmp_path / "c", FakeSandbox()).interpreter(EnvSpec("3.99", ()))


# ------------------------------------------------------------------ attack: a malicious setup.py
EVIL_SETUP = """
import os, sys
report = []
for path in {secrets!r}:
    try:
        report.append("READ " + path + " " + open(path).read())
    except OSError as exc:
        report.append("DENIED " + path + " " + type(exc).__name__)
for path in {targets!r}:
    try:
        with open(path, "w") as f:
            f.write("pwned")
        report.append("WROTE " + path)
    except OSError as exc:
        report.append("DENIED-WRITE " + path + " " + type(exc).__name__)
report.append("LISTROOT " + " ".join(sorted(os.listdir("/"))))
for name, target in {plants!r}:
    try:
        os.symlink(target, "{mount}/" + name)
    except OSError as exc:
        report.append("NO-SYMLINK " + name + " " + type(exc).__name__)
try:
    os.link({victim!r}, "{mount}/hardlink")
    report.append("LINKED")
except OSError as exc:
    report.append("NO-HARDLINK " + type(exc).__name__)
report.append("NETDEVS " + " ".join(l.split(":")[0].strip() for l in open("/proc/net/dev").readlines()[2:]))
report.append("EVIL-RAN uid=%d" % os.getuid())
text = "\\n".join(report)
print(text)
open("{mount}/evil-report.txt", "w").write(text)
from setuptools import setup
setup(name="evilpkg", version="0.1")
"""


@pytest.mark.sandbox
def test_malicious_setup_py_is_contained(tmp_path, wheelhouse, sandbox):
    secret_dir = tmp_path / "host-secret"
    secret_dir.mkdir()
    secret = secret_dir / "token.txt"
    secret.write_text("SECRET-TOKEN-1f2e3d")
    outside = tmp_path / "written-outside"
    cache_root = tmp_path / "cache"
    wh = tmp_path / "evil-wheelhouse"
    wh.mkdir()
    for p in wheelhouse.iterdir():
        (wh / p.name).write_bytes(p.read_bytes())
    project_file = REPO / "pyproject.toml"
    targets = [str(outside), str(cache_root / "sibling"), f"{ENV_MOUNT}/../escaped", "/usr/pwned", "/etc/pwned"]
    # Symlinks to host files planted where the sealing step writes and chmods, and a hard link to a
    # file the sandbox shows: sealing must change neither file.
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched")
    victim.chmod(0o644)
    plants = [(".composer-jax-env.json", str(victim)), ("bin-victim", str(victim))]
    setup_py = EVIL_SETUP.format(
        secrets=[str(secret), str(project_file), "/etc/shadow", "/root/.bash_history"],
        targets=targets,
        mount=ENV_MOUNT,
        plants=plants,
        victim="/etc/hostname",
    )
    hostname_stat = os.stat("/etc/hostname")
    _sdist(wh, "evilpkg", textwrap.dedent(setup_py))
    cache = EnvCache(cache_root, sandbox, wheelhouse=wh)

    async def twice():  # two callers at once: one build
        return await asyncio.gather(*(cache.ensure(EnvSpec(None, ("evilpkg",)), None) for _ in range(2)))

    env, same = asyncio.run(twice())
    assert env == same and list(cache.build_seconds) == [env.key]
    report = (env.host_path / "evil-report.txt").read_text()
    assert "EVIL-RAN" in report and "uid=0" not in report, report  # it ran, unprivileged
    assert "READ " not in report, report  # nothing of the host was readable
    assert "WROTE " not in report, report
    assert "\nNETDEVS lo\n" in report, report  # a wheelhouse build has no network (loopback only)
    assert not outside.exists() and not (cache_root / "sibling").exists() and not Path("/usr/pwned").exists()
    assert sorted(p.name for p in cache_root.iterdir()) == [env.key]  # no leftovers beside the entry
    assert victim.read_text() == "untouched" and victim.stat().st_mode & 0o777 == 0o644
    assert os.stat("/etc/hostname") == hostname_stat
    assert json.loads((env.host_path / ".composer-jax-env.json").read_text())["key"] == env.key
    assert not (env.host_path / ".composer-jax-env.json").is_symlink()
    tree = b"".join(p.read_bytes() for p in env.host_path.rglob("*") if p.is_file() and not p.is_symlink())
    assert b"SECRET-TOKEN-1f2e3d" not in tree and project_file.read_bytes()[:200] not in tree


@pytest.mark.sandbox
def test_network_only_for_index_builds(sandbox):
    lease = sandbox.lease("argv-probe")
    try:
        args = {"mounts": [], "cwd": "/", "limits": Limits(), "env": {}}
        _, _, plain = lease._argv(SandboxCommand(["true"], **args))
        _, _, networked = lease._argv(SandboxCommand(["true"], **args, network=True))
    finally:
        asyncio.run(lease.close())
    assert "--unshare-net" in plain and "--unshare-net" not in networked


def test_dockerfile_matches_the_spec():
    from composer_jax.env.mining.taskwrite import default_dockerfile

    plain = default_dockerfile()
    assert plain.startswith("FROM python:3.11-slim\n") and "pip install --no-cache-dir pytest==" in plain
    text = default_dockerfile(EnvSpec("3.12", ("attrs==23.2.0", "numpy>=1.26"), "editable"))
    lines = text.splitlines()
    assert lines[0] == "FROM python:3.12-slim"
    assert "RUN pip install --no-cache-dir attrs==23.2.0 'numpy>=1.26'" in lines
    assert lines.index("COPY app/ /app/") < lines.index("RUN pip install --no-cache-dir -e /app")


@pytest.mark.sandbox
def test_editable_app_points_at_the_session_workspace(tmp_path, wheelhouse, sandbox):
    root = _task(tmp_path / "tasks" / "editable-app", [], install_app="editable")
    app = root / "environment" / "app"
    (app / "applib").mkdir()
    (app / "applib" / "__init__.py").write_text("def f():\n    return 'original'\n")
    (app / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "applib"\nversion = "0.1"\n[tool.setuptools]\npackages = ["applib"]\n'
    )
    store = TaskStore(tmp_path / "tasks", tmp_path / "gen")
    cache = EnvCache(tmp_path / "cache", sandbox, wheelhouse=wheelhouse)
    probe = "cd /tmp && python3 -c 'import applib; print(applib.f())'"

    async def go():
        await for_task(cache, store.get("editable-app"))
        manager = SessionManager(store, sandbox, work_dir=tmp_path / "work", env_cache=cache)
        try:
            s = await manager.create("editable-app")
            before = await s.run_shell(probe, 30)
            await s.run_shell("sed -i s/original/edited/ /app/applib/__init__.py", 30)
            return before, await s.run_shell(probe, 30)
        finally:
            await manager.shutdown()

    before, after = asyncio.run(go())
    assert before.stdout.strip() == "original", before
    assert after.stdout.strip() == "edited", after  # the install points at /app, the workspace
    assert not any(p.name.endswith(".egg-info") for p in app.iterdir())  # the build used a copy


@pytest.mark.sandbox
@needs_bwrap  # `env build` needs bubblewrap before it reads its flags
def test_cli_env_flags_errors(tmp_path, capsys):

    (tmp_path / "tasks").mkdir()
    assert cli_main(["env", "build", str(tmp_path / "tasks"), "--wheelhouse", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "--wheelhouse" in err and "not a directory" in err, err
    args = ["build", str(tmp_path / "tasks"), "--wheelhouse", str(tmp_path), "--index-url", "http://x"]
    assert cli_main(["env", *args]) == 2
    assert "not both" in capsys.readouterr().err
    assert cli_main(["env", "build", str(tmp_path / "tasks"), "--index-url", "file:///etc"]) == 2
    assert "expected an http:// or https:// URL" in capsys.readouterr().err


@pytest.mark.sandbox
def test_env_build_cli_reports_each_env(built, wheelhouse, capsys):
    from composer_jax.env.cli import env_main

    cache, tasks, env, _ = built
    assert env_main(["build", str(tasks), "--env-cache", str(cache.root), "--wheelhouse", str(wheelhouse)]) == 0
    out = capsys.readouterr().out
    assert f"env uses-tinypkg: {env.key[:16]} python {env.python_version} cached" in out, out


@pytest.mark.sandbox
def test_failed_build_is_remembered_with_its_log(tmp_path, wheelhouse, sandbox):
    cache = EnvCache(tmp_path / "cache", sandbox, wheelhouse=wheelhouse)
    spec = EnvSpec(None, ("not-in-wheelhouse==1.0",))

    async def go():
        errors = []
        for _ in range(2):
            with pytest.raises(EnvBuildError) as err:
                await cache.ensure(spec, None)
            errors.append(err.value)
        return errors

    first, second = asyncio.run(go())
    assert first is second  # not rebuilt
    assert cache.builds == {"failed": 1} and cache.counts() == {"built": 0, "failed": 1}
    assert "failed (exit 1)" in first.reason and "not-in-wheelhouse" in first.log_tail
    assert cache.build_seconds == {} and [p.name for p in (tmp_path / "cache").iterdir()] == []


def test_session_of_an_unbuilt_env_is_refused_not_built(tmp_path):
    from composer_jax.env.api.errors import TaskNotRunnable
    from composer_jax.env.sandbox.runner import LocalProcessSandbox

    _task(tmp_path / "tasks" / "uses-tinypkg", ["tinypkg"])
    store = TaskStore(tmp_path / "tasks", tmp_path / "gen")
    cache = EnvCache(tmp_path / "cache", LocalProcessSandbox())

    async def go(env_cache):
        manager = SessionManager(store, LocalProcessSandbox(), work_dir=tmp_path / "work", env_cache=env_cache)
        try:
            with pytest.raises(TaskNotRunnable) as err:
                await manager.create("uses-tinypkg")
            return str(err.value)
        finally:
            await manager.shutdown()

    assert "is not built" in asyncio.run(go(cache)) and not (tmp_path / "cache").exists()  # never builds
    assert "no env cache" in asyncio.run(go(None))
    with pytest.raises(EnvBuildError, match="need the bubblewrap sandbox"):
        asyncio.run(cache.ensure(EnvSpec(None, ("tinypkg",)), None))


def test_stale_build_dirs_are_swept(tmp_path):
    from composer_jax.env.sandbox.pyenv import sweep_stale_builds

    old, new, entry = tmp_path / ".build-old", tmp_path / ".build-new", tmp_path / ("a" * 64)
    for d in (old, new, entry):
        (d / "env").mkdir(parents=True)
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    os.utime(entry, (time.time() - 7200, time.time() - 7200))
    assert sweep_stale_builds(tmp_path, max_age_s=3600) == [".build-old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".build-new", "a" * 64]
