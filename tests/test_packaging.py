"""The bundled data (configs/, assets/, tasks/, docs/) is found in a checkout and in an installed wheel
(src/composer_jax/resources.py, setup.py), and the demo reads it from any directory.

The default tests check the lookup on a checkout and on a package laid out as the wheel lays it;
the slow one builds the real wheel, installs it into a fresh virtual environment and runs
`composer-jax demo --quick` and `composer-jax env-server` from a temporary directory, checking that
nothing is written outside the output folder given."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest

from composer_jax import resources

ROOT = Path(__file__).resolve().parents[1]


def _load_setup_module():
    spec = importlib.util.spec_from_file_location("composer_jax_setup", ROOT / "setup.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    import setuptools

    real_setup, setuptools.setup = setuptools.setup, lambda **kw: None  # read BUNDLED, build nothing
    try:
        spec.loader.exec_module(mod)
    finally:
        setuptools.setup = real_setup
    return mod


def _resources_at(package_dir: Path):
    """resources.py loaded as if it were installed in package_dir (its lookups start from its own file)."""
    package_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "src" / "composer_jax" / "resources.py", package_dir / "resources.py")
    spec = importlib.util.spec_from_file_location("resources_copy", package_dir / "resources.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_checkout_lookup_finds_the_repository_data():
    assert not resources.is_packaged()
    assert resources.data_root() == ROOT
    assert resources.data_path("configs", "model", "tiny.yaml") == ROOT / "configs" / "model" / "tiny.yaml"
    assert resources.data_path("tasks").is_dir() and (resources.data_path("tasks") / "lru-optimise").is_dir()
    assert resources.code_root() == ROOT / "src"


def test_bad_kind_names_the_value_and_the_accepted_ones():
    with pytest.raises(ValueError, match=r"'config' is not accepted; accepted: configs, assets, tasks, docs"):
        resources.data_path("config")


def test_wheel_layout_lookup(tmp_path):
    # site-packages/composer_jax/{resources.py, _data/...}: the packaged copy, the package as code root
    pkg = tmp_path / "site-packages" / "composer_jax"
    (pkg / "_data" / "configs" / "model").mkdir(parents=True)
    (pkg / "_data" / "tasks").mkdir()
    mod = _resources_at(pkg)
    assert mod.is_packaged() and mod.data_root() == pkg / "_data"
    assert mod.data_path("configs", "model", "tiny.yaml") == pkg / "_data" / "configs" / "model" / "tiny.yaml"
    assert mod.data_path("tasks") == pkg / "_data" / "tasks"
    assert mod.code_root() == pkg
    with pytest.raises(mod.DataNotFoundError, match="assets"):  # a folder the copy lacks is named
        mod.data_path("assets")


def test_no_data_anywhere_is_a_clear_error(tmp_path):
    mod = _resources_at(tmp_path / "a" / "b" / "composer_jax")
    with pytest.raises(mod.DataNotFoundError, match=r"neither .*_data.* nor a checkout"):
        mod.data_root()


def test_the_wheel_carries_every_kind():
    assert tuple(_load_setup_module().BUNDLED) == resources.KINDS


def _pins(lock: Path) -> dict[str, str]:
    """A lock file's `name==version` lines (comments and blank lines skipped)."""
    lines = (ln.split("#")[0].strip() for ln in lock.read_text().splitlines())
    return dict(ln.split("==", 1) for ln in lines if ln)


def test_the_ray_extra_pins_what_its_lock_pins_and_the_base_install_leaves_ray_out():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lock = _pins(ROOT / "locks" / "ray.lock")
    assert lock == {"ray": "2.60.0"}
    assert project["optional-dependencies"]["ray"] == [f"ray=={lock['ray']}"]
    names = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    assert "ray" not in names  # `--placement ray` is the extra's; nothing else needs Ray


# run with Ray unimportable (a None entry in sys.modules makes `import ray` raise ImportError)
WITHOUT_RAY = """
import sys
sys.modules["ray"] = None
import composer_jax, composer_jax.cli, composer_jax.inspection
from composer_jax.config import load_config
cfg = load_config("configs/rl/tiny_families.yaml", ["rl.placement=ray"], num_devices=None)
assert cfg.rl.placement == "ray"
assert composer_jax.cli.main(["inspect", "configs/rl/tiny_families.yaml", "rl.placement=ray"]) == 0
print("ok")
"""


def test_the_package_runs_without_ray():
    out = subprocess.run([sys.executable, "-c", WITHOUT_RAY], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "ok", out.stdout[-2000:] + out.stderr[-3000:]


def test_demo_points_every_stage_at_the_bundled_data():
    from composer_jax import demo

    for _, path in (*demo.STAGES, demo.RL_STAGE):
        cfg = demo.cj.load_config(demo.stage_config(path), demo.bundled_overrides(path), num_devices=None)
        base = demo.cj.load_config(demo.stage_config(path), num_devices=None)
        assert Path(cfg.data.tokenizer).is_absolute() and Path(cfg.data.tokenizer).is_dir()
        assert Path(cfg.rl.tasks_dir) == ROOT / "tasks"
        # the same sources (a checkout has them all), absolute, with the labels the relative paths gave
        assert [s.label for s in cfg.data.sources] == [s.label for s in base.data.sources]
        assert [Path(s.path) for s in cfg.data.sources] == [ROOT / s.path for s in base.data.sources]
        assert [s.weight for s in cfg.data.sources] == [s.weight for s in base.data.sources]


def test_demo_clears_only_its_own_outputs(tmp_path):
    from composer_jax.demo import OUTPUTS, prepare_out

    out = tmp_path / "out"
    (out / "stage1" / "checkpoints").mkdir(parents=True)
    (out / "report.md").write_text("old")
    (out / "notes.txt").write_text("mine")
    (out / "mine").mkdir()
    assert "stage1" in OUTPUTS and "report.md" in OUTPUTS
    assert prepare_out(out) == out.resolve()
    assert sorted(p.name for p in out.iterdir()) == ["mine", "notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is not a folder"):
        prepare_out(tmp_path / "file")


# run by the installed interpreter: per tiny stage, (tokenizer, [(label, path, files or documents)], tasks dir)
STAGE_PATHS = """
import json
from pathlib import Path
import composer_jax as cj
from composer_jax.demo import STAGES, RL_STAGE, bundled_overrides, stage_config
from composer_jax.data.sources import list_directory_files
out = {}
for name, path in (*STAGES, RL_STAGE):
    cfg = cj.load_config(stage_config(path), bundled_overrides(path, echo=lambda s: None), num_devices=None)
    srcs = []
    for s in cfg.data.sources:
        if s.type == "directory":
            files = list_directory_files(s.path, include=s.include, exclude=s.exclude, max_file_bytes=s.max_file_bytes)
            assert not [f for f in files if f.startswith("_data/")], s.label
            count = len(files)
        else:
            count = sum(1 for line in Path(s.path).read_text().splitlines() if line.strip())
        srcs.append((s.label, s.path, count))
    out[name] = (cfg.data.tokenizer, srcs, cfg.rl.tasks_dir)
print(json.dumps(out))
"""


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_wheel_runs_outside_a_checkout(tmp_path):
    # the sources the build reads, copied: building writes build/ and *.egg-info beside them
    src = tmp_path / "source"
    shutil.copytree(
        ROOT / "src" / "composer_jax", src / "src" / "composer_jax", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pallas_kernels", *resources.KINDS):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    run = lambda cmd, **kw: subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)  # noqa: E731
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(src)]
    )
    (wheel,) = tmp_path.glob("composer_jax-*.whl")

    # a fresh venv that sees this interpreter's packages (the dependencies; nothing is downloaded) through
    # a .pth line - which adds the folder but runs none of its .pth files, so the editable checkout stays out
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    site = Path(run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "composer_jax_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q", str(wheel)])

    work, home, tmp, cache = tmp_path / "work", tmp_path / "home", tmp_path / "tmp", tmp_path / "cache"
    for d in (work, home, tmp, cache):
        d.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JAX_COMPILATION_CACHE_DIR")}
    # the user's cache directory is where the sandbox keeps its verifier toolchain (built once)
    env.update(HOME=str(home), TMPDIR=str(tmp), XDG_CACHE_HOME=str(cache))
    where = json.loads(
        run(
            [
                str(py),
                "-c",
                "import json, composer_jax, composer_jax.resources as r; "
                "print(json.dumps([composer_jax.__file__, str(r.data_path('tasks')), str(r.data_root())]))",
            ],
            cwd=work,
            env=env,
        ).stdout
    )
    pkg = Path(where[0]).parent
    assert pkg == site / "composer_jax", where  # the wheel's copy, not the checkout
    tasks = Path(where[1])
    assert tasks == pkg / "_data" / "tasks" and (tasks / "lru-optimise" / "task.toml").is_file()
    # every tiny stage's data resolves into the package: stage 1's corpus is the installed code (its
    # _data/ left out), the tests/ source (not shipped) dropped, the rest found under _data/
    stages = json.loads(run([str(py), "-c", STAGE_PATHS], cwd=work, env=env).stdout.splitlines()[-1])
    for name, (tokenizer, sources, tasks_dir) in stages.items():
        assert Path(tokenizer) == pkg / "_data" / "assets" / "tokenizer" and Path(tasks_dir) == tasks, name
        for label, path, count in sources:
            assert Path(path).is_relative_to(pkg) and count > 0, (name, label, path)
    stage1 = {label: (path, count) for label, path, count in stages["stage1"][1]}
    assert sorted(stage1) == ["directory:docs", "directory:src"]
    assert Path(stage1["directory:src"][0]) == pkg and stage1["directory:src"][1] > 50
    before = _tree(venv)

    exe = str(venv / "bin" / "composer-jax")
    demo = run([exe, "demo", "--quick", "--steps", "4", "--seq", "32", "--out", "out/demo"], cwd=work, env=env)
    assert "final next-token nll" in demo.stdout, demo.stdout + demo.stderr

    args = [exe, "env-server", "--tasks", str(tasks), "--port", "0", "--work-dir", str(work / "out" / "env")]
    if shutil.which("bwrap") is None:
        args.append("--unsafe-no-sandbox")
    server = subprocess.Popen(args, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        m = re.search(r"listening on (\S+) tasks=(\d+)", line)
        assert m, line + (server.stderr.read() if server.poll() is not None and server.stderr else "")
        assert int(m.group(2)) == sum(1 for p in tasks.iterdir() if (p / "task.toml").is_file())
        for _ in range(100):  # bounded: the socket listens before uvicorn serves
            try:
                with urllib.request.urlopen(f"{m.group(1)}/health", timeout=5) as r:
                    health = json.loads(r.read())
                break
            except OSError:
                time.sleep(0.1)
        else:
            pytest.fail("the environment server did not answer /health")
        assert health.get("status") == "healthy", health
    finally:
        server.terminate()
        server.wait(timeout=30)

    # written: only the output folder under the working directory; nothing in the venv, HOME or TMPDIR
    assert sorted(p.name for p in work.iterdir()) == ["out"]
    assert _tree(venv) == before
    assert list(home.rglob("*")) == [] and list(tmp.rglob("*")) == []
    # and in the cache directory, only what the sandbox keeps there (the verifier toolchain with a bwrap sandbox)
    assert {p.relative_to(cache).as_posix() for p in cache.glob("*/*")} <= {"composer_jax/toolchain"}
