"""`composer-jax env import-swebench INSTANCES.jsonl --repos DIR --out TASKS`: SWE-bench-format records as tasks.

Records as SWE-bench, SWE-Gym and SWE-rebench ship them: instance_id, repo ("owner/name"),
base_commit, patch (the gold solution), test_patch, problem_statement, FAIL_TO_PASS,
PASS_TO_PASS (lists, or JSON strings of lists), and optionally version, environment_setup_commit,
created_at. The repository comes from a local clone under DIR (DIR/owner__name, DIR/owner/name or
DIR/name). Each becomes the same task layout as a mined one (`taskwrite`), graded by SWE-bench's
rule: resolved iff every FAIL_TO_PASS and PASS_TO_PASS test passes, per-test report in the shape of
`swebench.harness.grading.get_eval_tests_report` (tests/env/mining/test_swebench_import.py checks it
against that package on the same logs).

Scope: Python repositories tested with pytest. The harness's per-repository install specs
(MAP_REPO_VERSION_TO_SPECS: conda environments, pre-install commands, Django's and SymPy's own
test runners, `tox`/`bin/test` invocations) are out of scope; tests run with pytest in the
environment the task declares: as `env mine` does (`projectenv.py`), the repository's own declared
requirements at the base commit, the project installed when its metadata requires it, and, when
environments are built here, everything resolved as of the record's `created_at` (pytest included)
and recorded as `pins`; built with `--wheelhouse` / `--index-url` (`--env-cache`) before the task is
validated, so "environment did not build" is a reason of its own. The tests a task runs are the
test patch's Python files that exist once it is applied (a file the test patch deletes is not a
target).

An instance whose repository or base commit is missing, whose patch or test patch does not apply,
or whose environment does not build is reported, not written; so is one whose gold patch does not
validate (oracle 1, untouched 0) here, unless `--no-validate`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

from composer_jax.env.api.errors import TaskError
from composer_jax.env.mining import gitrepo, projectenv
from composer_jax.env.mining.gitrepo import Commit, GitError
from composer_jax.env.mining.statement import category_of
from composer_jax.env.mining.taskwrite import RepoTask, harness_safe, patched_paths, with_pins, write_task
from composer_jax.env.sandbox import pyenv
from composer_jax.env.sandbox.pyenv import BuiltEnv, EnvBuildError, EnvCache
from composer_jax.env.sandbox.runner import Limits, Sandbox
from composer_jax.env.tasks import validate
from composer_jax.env.tasks.envspec import utc_instant
from composer_jax.env.tasks.store import load_task
from composer_jax.env.tasks.task_env import for_task
from composer_jax.errors import UsageError

REQUIRED = ("instance_id", "repo", "base_commit", "patch", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS")
REASONS = (
    "invalid record",
    "repository missing",
    "base commit missing",
    "patch does not apply",
    "environment did not build",
    "oracle failed",
)


class InstanceError(Exception):
    def __init__(self, reason: str, detail: str):
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def test_list(record: dict, field: str) -> list[str]:
    """A FAIL_TO_PASS / PASS_TO_PASS field: a list of strings, or a JSON string of one."""
    value = record.get(field)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise InstanceError("invalid record", f"{field} is a string but not JSON: {value[:80]!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InstanceError(
            "invalid record", f"{field} must be a list of test ids or a JSON string of one, got {value!r:.80}"
        )
    return value


def load_instances(path: Path) -> list[tuple[int, dict | None, str]]:
    """[(line number, record or None, why not)] of a JSON-lines file (a .json list is read too)."""
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
        return [(i + 1, r, "") if isinstance(r, dict) else (i + 1, None, "not an object") for i, r in enumerate(data)]
    out: list[tuple[int, dict | None, str]] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            out.append((n, None, f"not JSON: {exc}"))
            continue
        out.append((n, record, "") if isinstance(record, dict) else (n, None, "not a JSON object"))
    return out


def find_clone(repos: Path, name: str) -> Path | None:
    owner, _, short = name.partition("/")
    for candidate in (repos / f"{owner}__{short}", repos / owner / short, repos / short, repos / name):
        if (candidate / ".git").exists() or (candidate / "HEAD").is_file():
            return candidate
    return None


def record_date(record: dict) -> str | None:
    """The record's `created_at` as an RFC 3339 UTC instant, or None when it has none that parses."""
    try:
        return utc_instant(str(record["created_at"])) if record.get("created_at") else None
    except ValueError:
        return None


def to_task(record: dict, repos: Path, work: Path, dated: bool = False) -> tuple[RepoTask, Path]:
    """The RepoTask of one record and the base tree it was checked against (under `work`);
    `dated`: its environment resolved as of the record's `created_at` (`projectenv.py`)."""
    missing = [k for k in REQUIRED if k not in record]
    if missing:
        raise InstanceError("invalid record", f"missing {', '.join(missing)}; a record needs {', '.join(REQUIRED)}")
    f2p, p2p = test_list(record, "FAIL_TO_PASS"), test_list(record, "PASS_TO_PASS")
    iid, name = str(record["instance_id"]), str(record["repo"])
    clone = find_clone(repos, name)
    if clone is None:
        raise InstanceError(
            "repository missing", f"no clone of {name} under {repos} ({name.replace('/', '__')}/, {name}/)"
        )
    base = work / "base"
    try:
        gitrepo.write_tree(clone, str(record["base_commit"]), base)
    except GitError as exc:
        raise InstanceError("base commit missing", f"{record['base_commit']} in {clone}: {exc}") from None
    base_commit, date = str(record["base_commit"]), record_date(record) if dated else None
    try:
        project = projectenv.project_environment(clone, base_commit, date)
    except gitrepo.DependencyGroupError as exc:
        raise InstanceError("environment did not build", str(exc)) from None
    projectenv.write_generated(base, project)
    patch, test_patch = str(record["patch"]).encode(), str(record["test_patch"]).encode()
    for label, p in (("patch", patch), ("test_patch", test_patch)):
        try:
            gitrepo.apply(base, p, check_only=True)
        except GitError as exc:
            raise InstanceError("patch does not apply", f"{label}: {exc}") from None
    test_files = tests_after(base, test_patch, work / "tests-applied")
    statement = str(record.get("problem_statement") or "").strip() or f"Resolve {iid}."
    subject = statement.splitlines()[0]
    commit = Commit(str(record["base_commit"]), None, "", subject, statement)
    extra = {k: record[k] for k in ("version", "environment_setup_commit") if isinstance(record.get(k), str)}
    task = RepoTask(
        task_id=harness_safe(iid),
        instance_id=iid,
        repo=name,
        base_commit=str(record["base_commit"]),
        commit_date=str(record.get("created_at") or ""),
        category=category_of(commit, [], {}, []),
        instruction=statement,
        test_patch=test_patch,
        solution_patch=patch,
        test_files=test_files,
        fail_to_pass=f2p,
        pass_to_pass=p2p,
        source="swebench",
        changed_files=len(patched_paths(patch)),
        changed_lines=sum(
            1
            for line in patch.decode("utf-8", "replace").splitlines()
            if line[:1] in "+-" and not line.startswith(("+++", "---"))
        ),
        extra_metadata={**extra, **({"install_rule": project.install_rule} if project.install_rule else {})},
        environment=project.environment(),
    )
    return task, base


def tests_after(base: Path, test_patch: bytes, scratch: Path) -> list[str]:
    """The test patch's Python files that exist once it is applied to `base` (a copy at `scratch`)."""
    shutil.copytree(base, scratch, symlinks=True)
    try:
        gitrepo.apply(scratch, test_patch)
        return [p for p in patched_paths(test_patch) if p.endswith(".py") and (scratch / p).is_file()]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


async def build_environment(root: Path, env_cache: EnvCache | None) -> BuiltEnv | None:
    """Build the environment the task at `root` declares (None: it declares none); InstanceError
    when it cannot be."""
    try:
        task = await asyncio.to_thread(load_task, root)
    except TaskError as exc:
        raise InstanceError("invalid record", str(exc)) from None
    spec = task.config.environment
    if spec is None:
        return None
    wanted = ", ".join(spec.requirements)
    if env_cache is None:
        why = f"the project needs {wanted}; give --wheelhouse or --index-url"
        raise InstanceError("environment did not build", why)
    try:
        return await for_task(env_cache, task)
    except EnvBuildError as exc:
        raise InstanceError("environment did not build", f"{wanted}: {exc.reason} {exc.log_tail[-300:]}") from None


async def import_all(
    records: list[tuple[int, dict | None, str]],
    repos: Path,
    out: Path,
    sandbox: Sandbox | None,
    progress=None,
    env_cache: EnvCache | None = None,
    dated: bool = False,
) -> list[dict]:
    """One result per record: {"line", "instance_id", "status": written|rejected, "reason", "detail", "task_id"};
    `dated`: environments resolved as of each record's `created_at` (needs `env_cache`)."""
    scratch = Path(tempfile.mkdtemp(prefix="composer-jax-import-"))
    limits = Limits(wall_seconds=600, cpu_seconds=601, memory_mb=4096)
    results = []
    try:
        for n, record, why in records:
            result: dict = {"line": n, "instance_id": (record or {}).get("instance_id"), "status": "rejected"}
            work = scratch / f"line-{n}"
            try:
                if record is None:
                    raise InstanceError("invalid record", why)
                task, base = await asyncio.to_thread(to_task, record, repos, work, dated and env_cache is not None)
                root = await asyncio.to_thread(write_task, task, base, out)
                if sandbox is not None:
                    problem = await _validated(root, sandbox, scratch, limits, env_cache, (task, base))
                    if problem is not None:
                        await asyncio.to_thread(shutil.rmtree, root, True)
                        raise problem
                result.update(status="written", task_id=task.task_id)
            except InstanceError as exc:
                result.update(reason=exc.reason, detail=exc.detail[:500])
            finally:
                await asyncio.to_thread(shutil.rmtree, work, True)
            results.append(result)
            if progress:
                progress(result)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return results


async def _validated(
    root: Path,
    sandbox: Sandbox,
    scratch: Path,
    limits: Limits,
    env_cache: EnvCache | None,
    written: tuple[RepoTask, Path],
) -> InstanceError | None:
    """Why the written task at `root` is not kept (its environment, then its oracle), or None. A
    dated environment's resolution is recorded as `pins` (the task rewritten) before the oracle
    runs, so validation builds what the task.toml says."""
    try:
        env = await build_environment(root, env_cache)
    except InstanceError as exc:
        return exc
    task, base = written
    pinned = with_pins(task, env.installed if env is not None else ())
    if env is not None and (plugins := pyenv.pytest_plugins(env)):  # the sandbox does not autoload them
        pinned = dataclasses.replace(pinned, pytest_plugins=list(plugins))
    if pinned is not task:
        await asyncio.to_thread(write_task, pinned, base, root.parent)
    problem = await validate.check_written(root, sandbox, scratch, limits, env_cache)
    return InstanceError("oracle failed", problem) if problem else None


def summary(results: list[dict]) -> dict:
    reasons = Counter(r.get("reason") for r in results if r["status"] == "rejected")
    return {
        "instances": len(results),
        "written": sum(r["status"] == "written" for r in results),
        "rejected": {r: reasons[r] for r in REASONS if reasons[r]},
    }


def import_parser() -> argparse.ArgumentParser:
    from composer_jax.env.sandbox.factory import add_env_cache_flags

    p = argparse.ArgumentParser(
        prog="composer-jax env import-swebench",
        description="Turn SWE-bench-format instance records into Harbor tasks graded by SWE-bench's rule.",
    )
    p.add_argument("instances", type=Path, help="a JSON-lines file of instance records (or a .json list)")
    p.add_argument("--repos", type=Path, required=True, help="directory of local clones (owner__name/ or owner/name/)")
    p.add_argument("--out", type=Path, required=True, help="directory the tasks are written under")
    p.add_argument("--no-validate", action="store_true", help="write without checking oracle 1 / untouched 0")
    p.add_argument("--unsafe-no-sandbox", action="store_true", help="run without bubblewrap (NO isolation)")
    add_env_cache_flags(p)
    projectenv.add_resolve_flag(p)
    return p


def import_main(argv: list[str]) -> int:
    from composer_jax.env.sandbox.factory import make_env_cache, make_sandbox, source_problem_lines

    args = import_parser().parse_args(argv)
    if not args.instances.is_file():
        raise UsageError(f"{args.instances} is not a file of instance records")
    if not args.repos.is_dir():
        raise UsageError(f"--repos {args.repos} is not a directory of clones")
    try:
        records = load_instances(args.instances)
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"{args.instances} is not JSON lines: {exc}") from exc
    sandbox = None if args.no_validate else make_sandbox(args.unsafe_no_sandbox, 600)
    env_cache = make_env_cache(args, sandbox) if sandbox is not None else None

    def progress(r: dict) -> None:
        what = r.get("task_id") if r["status"] == "written" else f"{r['reason']}: {r['detail'][:160]}"
        print(f"  line {r['line']:>4} {r['instance_id']} {r['status']} {what}", file=sys.stderr, flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    dated = projectenv.dated(args)
    results = asyncio.run(import_all(records, args.repos, args.out, sandbox, progress, env_cache, dated))
    s = summary(results)
    s["package_source_problems"] = dict(getattr(env_cache, "source_problems", {}))
    (args.out / "import_report.json").write_text(json.dumps({**s, "instances_detail": results}, indent=1) + "\n")
    print(f"{s['instances']} instances, {s['written']} tasks written")
    for reason, count in s["rejected"].items():
        print(f"  rejected  {count:>5}  {reason}")
    for line in source_problem_lines(s["package_source_problems"]):
        print(line)
    return 0 if s["written"] else 1
