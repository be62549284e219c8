"""Task environments for repositories as they were (issue 41, item 2): a project whose version
module is generated at install time gets installed; an old test suite gets the pytest of its
commit's date, resolved by uv's --exclude-newer against an index's upload times, recorded in
task.toml as exact pins and rebuilt identically from them."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import tomllib
from pathlib import Path

import pytest
from support import dated_index, minerepo
from support.bwrap import needs_bwrap

from composer_jax.env.api.errors import TaskError
from composer_jax.env.mining import miner as mine
from composer_jax.env.mining import projectenv
from composer_jax.env.sandbox.pip_sources import PipSources
from composer_jax.env.sandbox.pyenv import BuiltEnv, EnvCache
from composer_jax.env.sandbox.runner import Limits, Mount, default_sandbox
from composer_jax.env.sandbox.spec import EnvSpec
from composer_jax.env.tasks.envspec import parse_environment
from composer_jax.env.tasks.store import load_task
from composer_jax.env.tasks.task_env import for_task

PYPROJECT_SCM = """\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "calc"
dynamic = ["version"]

[tool.setuptools]
packages = ["calc"]

# setuptools-scm writes calc/_version.py at build time; the version attr reads what it wrote
[tool.setuptools_scm]
version_file = "calc/_version.py"

[tool.setuptools.dynamic]
version = {attr = "calc._version.version"}
"""

INIT_SCM = """\
from importlib.metadata import version as _installed

from ._version import version as __version__

assert _installed("calc") == __version__, "calc is not installed"
"""

TEST_VERSION = """\
import calc
from calc.ops import div


def test_version():
    assert calc.__version__ == "1.4.0"


def test_div():
    assert div(1, 2) == 0.5
"""

# pytest 9 refuses a mark on a fixture at collection ("Marks cannot be applied to fixtures");
# pytest 8.4 only warns: a suite of that time needs a pytest of that time.
TEST_OLD_PYTEST = """\
import pytest

from calc.ops import div


@pytest.mark.usefixtures("tmp_path")
@pytest.fixture
def half():
    return 0.5


def test_div(half):
    assert div(1, 2) == half
"""


@pytest.fixture(scope="module")
def dated_wheels(tmp_path_factory) -> dict[Path, str]:
    """Real wheels of pytest 8.4.2 and 9.1.1 and of what they need, with the upload times this test's
    index tells: the dependencies long before, pytest 8.4.2 on 2025-09-04, pytest 9 on 2026-01-10."""
    wheels = dated_index.offline_wheels(
        ["pytest==8.4.2", "pytest==9.1.1", "pluggy==1.6.0", "iniconfig", "packaging", "pygments"],
        tmp_path_factory.mktemp("wheels"),
    )
    uploaded = {path: "2024-01-02T00:00:00Z" for path in wheels.values()}
    uploaded[wheels["pytest==8.4.2"]] = "2025-09-04T10:00:00Z"
    uploaded[wheels["pytest==9.1.1"]] = "2026-01-10T10:00:00Z"
    return uploaded


def _index_cache(root: Path, url: str) -> EnvCache:
    """Builds from the test's index alone (not the machine's other package sources)."""
    return EnvCache(root, default_sandbox(), sources=PipSources(url))


def _run_suite(env: BuiltEnv, suite: Path) -> tuple[int | None, str]:
    """pytest of `env` on the test file `suite`, in the sandbox: (exit status, output)."""

    async def run():
        lease = default_sandbox().lease(f"suite-{env.key[:8]}")
        try:
            argv = ["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", f"/suite/{suite.name}"]
            mounts = [Mount(suite.parent, "/suite", False), env.mount()]
            return await lease.run(
                argv, mounts=mounts, cwd="/suite", limits=Limits(wall_seconds=60), env=env.env_vars()
            )
        finally:
            await lease.close()

    result = asyncio.run(run())
    return result.exit_code, result.stdout + result.stderr


@pytest.mark.sandbox
@needs_bwrap
def test_a_dated_build_takes_the_pytest_of_its_date_and_its_pins_rebuild_it(tmp_path, dated_wheels):
    """As of 2025-09-10 uv resolves pytest 8.4.2, as of 2026-02-01 pytest 9.1.1 (the date decides);
    the old suite collects and passes under the first and not under the second; the first's exact
    set, given as pins, rebuilds identically in a fresh cache. (The miner's end-to-end use of this:
    the slow test_an_old_test_suite_gets_the_pytest_of_its_date_pinned_and_rebuilt.)"""
    suite = tmp_path / "suite" / "test_old.py"
    suite.parent.mkdir()
    suite.write_text(TEST_OLD_PYTEST.replace("from calc.ops import div", "def div(a, b):\n    return a / b"))
    with dated_index.serve(dated_wheels) as url:
        cache = _index_cache(tmp_path / "envs", url)
        then = asyncio.run(cache.ensure(EnvSpec(None, ("pytest",), exclude_newer="2025-09-10T12:00:00Z"), None))
        later = asyncio.run(cache.ensure(EnvSpec(None, ("pytest",), exclude_newer="2026-02-01T00:00:00Z"), None))
        pinned = EnvSpec(None, ("pytest",), exclude_newer="2025-09-10T12:00:00Z", pins=then.installed)
        rebuilt = asyncio.run(_index_cache(tmp_path / "fresh", url).ensure(pinned, None))
    assert (then.pytest, later.pytest) == ("8.4.2", "9.1.1")
    assert "pytest==8.4.2" in then.installed and "pluggy==1.6.0" in then.installed
    assert (rebuilt.installed, rebuilt.pytest) == (then.installed, "8.4.2")
    code, out = _run_suite(rebuilt, suite)
    assert code == 0 and "1 passed" in out, out
    code, out = _run_suite(later, suite)
    assert code != 0 and "Marks cannot be applied to fixtures" in out, out


def _repo(path: Path, first: dict[str, str], fix: dict[str, str], fix_date: str) -> Path:
    path.mkdir(parents=True)
    minerepo.git(path, "init", "-q", "-b", "main")
    minerepo.git(path, "remote", "add", "origin", "https://github.com/example/calc.git")
    minerepo.commit(path, "Initial calc package", first, 1)
    minerepo.git(path, "tag", "v1.4.0")
    minerepo.write(path, fix)
    minerepo.git(path, "add", "-A")
    minerepo.git(path, "commit", "-q", "-m", "Fix div: true division", date=fix_date)
    return path


def _mine_last(repo: Path, out: Path, cache: EnvCache) -> mine.Outcome:
    opts = mine.MineOptions(rev_range="HEAD~1..HEAD", runs=1, timeout_s=60.0, jobs=1, env_cache=cache, dated=True)
    (outcome,) = asyncio.run(mine.Miner(repo, out, default_sandbox(), opts).run())
    return outcome


def test_environment_keys_are_validated(tmp_path):
    """`exclude_newer`, `pins`, `app_version`: good values parse (a date is its UTC instant), bad ones
    name the key, the value and what is accepted."""
    spec = parse_environment(
        {"requirements": ["pytest"], "exclude_newer": "2025-09-10T14:00:00+02:00", "pins": ["pytest==8.4.2"]},
        tmp_path,
        "t",
    )
    assert spec == EnvSpec(None, ("pytest",), exclude_newer="2025-09-10T12:00:00Z", pins=("pytest==8.4.2",))
    for table, fragment in (
        ({"exclude_newer": "last tuesday"}, "exclude_newer = 'last tuesday' must be an RFC 3339 date-time"),
        ({"pins": ["pytest>=8"]}, "pins: 'pytest>=8' is not an exact pin; accepted: name==version"),
        ({"pins": "pytest==8.4.2"}, "pins = 'pytest==8.4.2' must be a list"),
        ({"app_version": 1.4}, "app_version = 1.4 must be a version string"),
    ):
        with pytest.raises(TaskError, match=fragment.replace("(", r"\(").replace(".", r"\.")):
            parse_environment(table, tmp_path, "t")


def test_detection_rules_read_the_tree(tmp_path):
    """Which rule installs a project: vcs-version (with the version module it writes), own-metadata,
    missing-module; a plain package is not installed; a date adds pytest and the cutoff."""
    setup = {"pyproject.toml": minerepo.PYPROJECT_V1}
    cases = {
        "vcs": ({"pyproject.toml": PYPROJECT_SCM, "calc/__init__.py": ""}, "vcs-version"),
        "nothing to install from": ({"calc/__init__.py": "from ._build_info import SHA\n"}, ""),
        "meta": (
            {**setup, "calc/__init__.py": "import importlib.metadata\nv = importlib.metadata.version('calc')\n"},
            "own-metadata",
        ),
        "gen": ({**setup, "src/calc/__init__.py": "from ._build_info import SHA\n"}, "missing-module"),
        "plain": ({**setup, "calc/__init__.py": "from .ops import add\n", "calc/ops.py": "add = 1\n"}, ""),
    }
    for name, (files, rule) in cases.items():
        repo = tmp_path / name
        repo.mkdir()
        minerepo.git(repo, "init", "-q", "-b", "main")
        minerepo.commit(repo, "c", files, 1)
        if name == "vcs":
            minerepo.git(repo, "tag", "v1.4.0")
        env = projectenv.project_environment(repo, "HEAD", "2024-03-01T12:00:00Z")
        assert env.install_rule == rule, name
        assert env.environment()["exclude_newer"] == "2024-03-01T12:00:00Z" and "pytest" in env.requirements
    vcs = projectenv.project_environment(tmp_path / "vcs", "HEAD", None)
    assert vcs.environment() == {"requirements": ["setuptools>=61"], "install_app": "editable", "app_version": "1.4.0"}
    assert vcs.generated["calc/_version.py"].splitlines()[1:] == [
        "__version__ = version = '1.4.0'",
        "__version_tuple__ = version_tuple = (1, 4, 0)",
    ]


@pytest.mark.slow
@pytest.mark.sandbox
@needs_bwrap
def test_a_generated_version_module_is_installed_and_the_task_validates(tmp_path):
    """The version module setuptools-scm writes at install time is not in the repository: from a
    source checkout `import calc` fails. The miner installs the project (editable, offline, from an
    empty wheelhouse: setuptools comes with the toolchain), writes the module as the tool would with
    the nearest tag's version, and the task is written and validates. (12 s: slow; the default
    test_detection_rules_read_the_tree keeps the rule and the module written, and
    tests/env/sandbox/test_pyenv.py's editable test the install.)"""
    first = {
        "pyproject.toml": PYPROJECT_SCM,
        ".gitignore": "calc/_version.py\n",
        "calc/__init__.py": INIT_SCM,
        "calc/ops.py": minerepo.OPS_V1,
        "tests/test_ops.py": minerepo.TEST_OPS_V1,
    }
    fix = {"calc/ops.py": minerepo.OPS_V2, "tests/test_ops.py": TEST_VERSION}
    repo = _repo(tmp_path / "calc", first, fix, "2024-03-02T12:00:00Z")
    (tmp_path / "wheelhouse").mkdir()
    cache = EnvCache(tmp_path / "envs", default_sandbox(), wheelhouse=tmp_path / "wheelhouse")
    outcome = _mine_last(repo, tmp_path / "out", cache)
    assert outcome.status == "written", outcome
    assert (outcome.fail_to_pass, outcome.pass_to_pass) == (
        ["tests/test_ops.py::test_div"],
        ["tests/test_ops.py::test_version"],
    )
    task = tmp_path / "out" / str(outcome.task_id)
    toml = tomllib.loads((task / "task.toml").read_text())
    env = toml["environment"]
    assert (env["install_app"], env["app_version"], env["exclude_newer"]) == (
        "editable",
        "1.4.0",
        "2024-03-02T12:00:00Z",
    )
    assert env["requirements"] == ["pytest", "setuptools>=61"] and toml["metadata"]["install_rule"] == "vcs-version"
    assert "__version__ = version = '1.4.0'" in (task / "environment" / "app" / "calc" / "_version.py").read_text()
    assert "ENV SETUPTOOLS_SCM_PRETEND_VERSION=1.4.0" in (task / "environment" / "Dockerfile").read_text()


@pytest.mark.slow
@pytest.mark.sandbox
@needs_bwrap
def test_an_old_test_suite_gets_the_pytest_of_its_date_pinned_and_rebuilt(tmp_path, dated_wheels):
    """A suite that pytest 9 refuses to collect, committed when pytest 8.4.2 was the newest: uv
    resolves pytest as of the commit's date from an index that knows upload times (real wheels of
    both pytests, served here), the suite runs under 8.4.2, the exact set lands in task.toml as
    pins, and a fresh cache rebuilds exactly those pins (a restarted one finds them on disk).
    (28 s: slow; the default test_a_dated_build_takes_the_pytest_of_its_date_and_its_pins_rebuild_it
    keeps the resolution, the pins and the pytest that collects.)"""
    first = {"calc/__init__.py": "", "calc/ops.py": minerepo.OPS_V1, "tests/test_ops.py": minerepo.TEST_OPS_V1}
    fix = {"calc/ops.py": minerepo.OPS_V2, "tests/test_ops.py": TEST_OLD_PYTEST}
    repo = _repo(tmp_path / "calc", first, fix, "2025-09-10T12:00:00Z")
    with dated_index.serve(dated_wheels) as url:
        outcome = _mine_last(repo, tmp_path / "out", _index_cache(tmp_path / "envs", url))
        assert outcome.status == "written", outcome
        assert outcome.fail_to_pass == ["tests/test_ops.py::test_div"]
        task = load_task(tmp_path / "out" / str(outcome.task_id))
        spec = task.config.environment
        assert spec is not None and spec.requirements == ("pytest",) and spec.exclude_newer == "2025-09-10T12:00:00Z"
        assert "pytest==8.4.2" in spec.pins and "pluggy==1.6.0" in spec.pins
        fresh = _index_cache(tmp_path / "envs2", url)
        rebuilt = asyncio.run(for_task(fresh, task))
        assert rebuilt is not None and (rebuilt.installed, rebuilt.pytest) == (spec.pins, "8.4.2")
        again = _index_cache(tmp_path / "envs2", url)
        assert asyncio.run(for_task(again, task)) == rebuilt and again.build_seconds == {}


def test_resolve_as_of_defaults_to_the_commit_only_with_an_index():
    """`--resolve-as-of`: `commit` by default with --index-url (an index may serve upload times),
    `today` otherwise (a wheelhouse or pip's configured indexes, which may be folders without them);
    either can be asked for; another value is refused by name."""
    from composer_jax.env.mining.cli import mine_parser
    from composer_jax.env.mining.swebench_import import import_parser

    def dated(*argv: str) -> bool:
        return projectenv.dated(mine_parser().parse_args(["repo", "--out", "o", *argv]))

    assert not dated() and not dated("--wheelhouse", "w")
    assert dated("--index-url", "https://pypi.org/simple")
    assert not dated("--index-url", "https://pypi.org/simple", "--resolve-as-of", "today")
    assert dated("--wheelhouse", "w", "--resolve-as-of", "commit")
    args = import_parser().parse_args(["i.jsonl", "--repos", "r", "--out", "o", "--index-url", "http://x/simple"])
    assert projectenv.dated(args)
    with pytest.raises(SystemExit):
        mine_parser().parse_args(["repo", "--out", "o", "--resolve-as-of", "yesterday"])


PYPROJECT_HATCH = """\
[build-system]
requires = ["hatchling", "hatch-vcs"]
build-backend = "hatchling.build"

[project]
name = "calc"
dynamic = ["version"]

[tool.hatch.version]
source = "vcs"

[tool.hatch.build.hooks.vcs]
version-file = "src/calc/_version.py"
"""


@pytest.mark.slow
@pytest.mark.sandbox
@needs_bwrap
def test_a_real_hatch_vcs_project_builds_from_the_spec_the_rules_give(tmp_path):
    """With the real hatchling, hatch-vcs and setuptools-scm (local wheels; skipped without them), the
    spec the rules read from a hatch-vcs project (its build requirements, hatchling's editables, the
    tag's version) installs it, offline and without .git, as calc 1.4.0; the version module the
    hook names is written for the workspace. (10 s: slow; the default test_detection_rules_read_the_tree
    keeps the rules, against a setuptools-scm configuration.)"""
    names = ["hatchling", "hatch-vcs", "setuptools-scm", "vcs-versioning", "pathspec", "trove-classifiers"]
    wheels = dated_index.offline_wheels([*names, "tomlkit", "editables"], tmp_path / "wheelhouse")
    files = {"pyproject.toml": PYPROJECT_HATCH, "src/calc/__init__.py": "from ._version import version\n"}
    repo = tmp_path / "calc"
    repo.mkdir()
    minerepo.git(repo, "init", "-q", "-b", "main")
    minerepo.commit(repo, "c", files, 1)
    minerepo.git(repo, "tag", "v1.4.0")
    project = projectenv.project_environment(repo, "HEAD", None)
    assert (project.install_rule, project.app_version) == ("vcs-version", "1.4.0")
    assert project.requirements == ["editables", "hatch-vcs", "hatchling"]
    app = tmp_path / "app"
    minerepo.write(app, files)
    projectenv.write_generated(app, project)
    assert "__version__ = version = '1.4.0'" in (app / "src" / "calc" / "_version.py").read_text()
    cache = EnvCache(tmp_path / "envs", default_sandbox(), wheelhouse=next(iter(wheels.values())).parent)
    env = dict(project.environment(), requirements=[*project.requirements, "pytest"])
    built = asyncio.run(cache.ensure(parse_environment(env, tmp_path, "t"), app))
    assert any(p.startswith("hatch-vcs==") for p in built.installed) and built.pytest
    assert list((built.host_path / "lib").glob("python3.*/site-packages/calc-1.4.0.dist-info"))


# PEP 735: `tests` includes `base` (whose name is spelled unnormalized) which includes `core`;
# `docs` and `lint` are not test groups; `dev` is read only where no test group exists
GROUPS = {
    "Core": ["attrs>=23"],
    "base": ["hypothesis", {"include-group": "CORE"}],
    "tests": ["pytest-timeout>=2.4", {"include-group": "base"}, "pytest>=8"],
    "docs": ["sphinx"],
    "dev": [{"include-group": "tests"}, {"include-group": "docs"}, "ruff"],
}


def test_dependency_groups_resolve_as_packaging_does():
    """The test groups of a `[dependency-groups]` table, includes expanded, are what `packaging`'s
    PEP 735 resolver gives for them; `dev` only without a test group; an include cycle, a missing
    group and a malformed entry are refused, naming the group."""
    from packaging.dependency_groups import CyclicDependencyGroup, resolve_dependency_groups

    from composer_jax.env.mining.gitrepo import DependencyGroupError, test_group_requirements

    assert test_group_requirements(GROUPS) == list(resolve_dependency_groups(GROUPS, "tests"))
    assert "sphinx" not in test_group_requirements(GROUPS)
    no_tests = {k: v for k, v in GROUPS.items() if k != "tests"} | {"dev": [{"include-group": "base"}, "ruff"]}
    assert test_group_requirements(no_tests) == list(resolve_dependency_groups(no_tests, "dev"))
    assert test_group_requirements({"docs": ["sphinx"]}) == [] == test_group_requirements([])
    cyclic = GROUPS | {"Core": ["attrs", {"include-group": "tests"}]}
    with pytest.raises(ExceptionGroup) as refused:  # the oracle refuses it too
        resolve_dependency_groups(cyclic, "tests")
    assert refused.group_contains(CyclicDependencyGroup)
    for table, fragment in (
        (cyclic, "group 'tests' includes itself (tests -> base -> core -> tests)"),
        (GROUPS | {"base": [{"include-group": "extra"}]}, "no group 'extra' (included by 'base')"),
        (GROUPS | {"base": [{"include": "core"}]}, "group 'base' has entry {'include': 'core'}; accepted:"),
        (GROUPS | {"tests": "hypothesis"}, "group 'tests' = 'hypothesis' must be a list"),
        (GROUPS | {"Tests": []}, "'Tests' names the same group as another"),
    ):
        with pytest.raises(DependencyGroupError, match=re.escape(fragment)):
            test_group_requirements(table)


def test_a_mined_commit_declares_its_test_groups_and_a_cycle_rejects_it(tmp_path):
    """Through the miner on the calc history: the commit's `[dependency-groups]` test group joins
    its declared requirements (pytest left to the verifier), and a commit whose groups include
    each other is rejected before any test runs ("environment did not build", naming the group)."""
    groups = '\n[dependency-groups]\ntest = ["hypothesis", {include-group = "lint"}, "pytest>=8"]\nlint = ["ruff"]\n'
    fix = {"pyproject.toml": minerepo.PYPROJECT_V1 + groups, "calc/ops.py": minerepo.OPS_V2}
    first = {"pyproject.toml": minerepo.PYPROJECT_V1, "calc/ops.py": minerepo.OPS_V1}
    repo = _repo(tmp_path / "r", first, fix | {"tests/test_ops.py": minerepo.TEST_OPS_V2}, "2024-03-02T12:00:00Z")
    assert projectenv.project_environment(repo, "HEAD", None).requirements == ["hypothesis", "ruff"]
    cyclic = fix["pyproject.toml"].replace('["ruff"]', '["ruff", {include-group = "test"}]')
    more = minerepo.TEST_OPS_V2 + "\n\ndef test_more():\n    pass\n"
    minerepo.write(repo, {"pyproject.toml": cyclic, "calc/ops.py": minerepo.OPS_V2 + "\n", "tests/test_ops.py": more})
    minerepo.git(repo, "commit", "-q", "-am", "Cyclic groups")
    opts = mine.MineOptions(rev_range="HEAD~1..HEAD", runs=1)
    (outcome,) = asyncio.run(mine.Miner(repo, tmp_path / "out", None, opts).run())
    assert (outcome.status, outcome.reason, outcome.tests_run) == ("rejected", "environment did not build", False)
    assert "group 'test' includes itself (test -> lint -> test)" in outcome.detail


def test_the_environments_pytest_plugins_are_named_in_the_task(tmp_path):
    """The sandbox turns pytest's plugin autoloading off, so a mined task names its environment's
    plugins (the `pytest11` entry points of what the build installed; other groups are not
    plugins) in `[verifier] pytest_plugins`, which the grader loads by name."""
    from composer_jax.env.mining.taskwrite import RepoTask, write_task
    from composer_jax.env.sandbox.pyenv import pytest_plugins

    site = tmp_path / "env" / "lib" / "python3.11" / "site-packages"
    for name, points in (
        ("pytest_asyncio", "[pytest11]\nasyncio = pytest_asyncio.plugin\n"),
        ("pytest_timeout", "[pytest11]\ntimeout = pytest_timeout\n[console_scripts]\nx = not_a.plugin:main\n"),
        ("virtualenv", "[console_scripts]\nvirtualenv = virtualenv.__main__:run\n"),
    ):
        meta = site / f"{name}-1.0.dist-info"
        meta.mkdir(parents=True)
        (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (meta / "entry_points.txt").write_text(points)
    plugins = pytest_plugins(BuiltEnv("k", tmp_path / "env", "3.11", ()))
    assert plugins == ("pytest_asyncio.plugin", "pytest_timeout")
    assert pytest_plugins(BuiltEnv("k", tmp_path / "none", "3.11", ())) == ()
    (tmp_path / "app").mkdir()
    new_test = b"diff --git a/tests/test_ops.py b/tests/test_ops.py\nnew file mode 100644\n--- /dev/null\n"
    new_test += b"+++ b/tests/test_ops.py\n@@ -0,0 +1 @@\n+x = 1\n"
    task = RepoTask("t", "t", "example/calc", "0" * 40, "", "bug fix", "Fix.", new_test, b"", ["tests/test_ops.py"])
    for listed in ([], list(plugins)):
        listing = dataclasses.replace(task, pytest_plugins=listed)
        root = write_task(listing, tmp_path / "app", tmp_path / str(len(listed)))
        assert load_task(root).config.pytest_plugins == tuple(listed)
