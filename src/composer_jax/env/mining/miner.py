"""`composer-jax env mine REPO --out DIR`: validated tasks from a repository's history.

A candidate is a first-parent commit (a merged PR counts once) that changes test files and
non-test files, 1 to `max_files` files and at most `max_changed_lines` lines, not only docs or
configuration. Its diff splits into the test patch (test files) and the solution patch (the rest).
Inside the sandbox, the test modules the test patch touches run at parent + test patch ("before")
and at parent + both patches ("after"), outcomes read from JUnit XML by the task's own verifier
(`tasks/verifier.py`). FAIL_TO_PASS = failed (or absent) before and passed after; PASS_TO_PASS = passed
on both sides. Each side runs `runs` times with a different PYTHONHASHSEED; a test whose outcome
changes between runs is flaky and dropped. A task is written only with at least one FAIL_TO_PASS
test and only if it validates through the server's grader (oracle 1, untouched 0).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from composer_jax.env.api.errors import TaskError
from composer_jax.env.mining import gitrepo, projectenv
from composer_jax.env.mining.gitrepo import Commit, FileChange, GitError
from composer_jax.env.mining.statement import category_of, write_instruction
from composer_jax.env.mining.taskwrite import RepoTask, harness_safe, with_pins, write_task
from composer_jax.env.sandbox import pyenv
from composer_jax.env.sandbox.factory import source_problem_lines
from composer_jax.env.sandbox.pyenv import BuiltEnv, EnvBuildError, EnvCache
from composer_jax.env.sandbox.runner import Limits, Mount, Sandbox, SandboxLease
from composer_jax.env.tasks import grader, validate
from composer_jax.env.tasks.store import Task, load_task
from composer_jax.env.tasks.task_env import for_task

REASONS = (
    "root commit",
    "no test change",
    "no source change",
    "docs/config only",
    "too large",
    "no test module",
    "patch does not apply",
    "environment did not build",
    "no FAIL_TO_PASS",
    "flaky",
    "oracle failed",
    "timed out",
)
# the reasons a commit is not a candidate: decided from its diff alone, before anything is built or run
SELECTION_REASONS = REASONS[:5]
# a run before the change that timed out: the tests it did not report are undecided, not failing
TIMED_OUT = "::timed-out"
MAX_PASS_TO_PASS = 1000  # above this, an evenly spaced sample of the sorted ids (the count is kept)


@dataclasses.dataclass
class MineOptions:
    rev_range: str = "HEAD"
    since: str | None = None
    until: str | None = None
    max_tasks: int | None = None
    jobs: int = 2
    max_files: int = 15
    max_changed_lines: int = 1000
    runs: int = 3
    timeout_s: float = 300.0
    writer: Callable[[dict], str] | None = None  # the OpenAI-compatible issue writer, if any
    # where tasks' declared environments are built (pyenv.py); None: only tasks that declare none
    env_cache: EnvCache | None = None
    # resolve each task's environment, pytest included, as of its commit's date (projectenv.py);
    # only with an env_cache (else tasks use the verifier's pytest and declare only what they need)
    dated: bool = False


@dataclasses.dataclass
class Outcome:
    sha: str
    status: str  # written | rejected
    reason: str = ""
    detail: str = ""
    task_id: str | None = None
    fail_to_pass: list[str] = dataclasses.field(default_factory=list)
    pass_to_pass: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    tests_run: bool = False  # its test modules ran in the sandbox (its environment built, the trees laid out)


class _Enough(Exception):
    """max_tasks tasks are written or being written: this job's task is not."""


class Rejected(Exception):
    def __init__(self, reason: str, detail: str = ""):
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def select(commit: Commit, changes: list[FileChange], opts: MineOptions) -> tuple[list[str], list[str]]:
    """(test paths, source paths) of a candidate; `Rejected` saying why a commit is none."""
    tests = [c.path for c in changes if gitrepo.is_test_path(c.path)]
    source = [c.path for c in changes if not gitrepo.is_test_path(c.path)]
    if source and not tests and all(gitrepo.is_docs_or_config(p) for p in source):
        raise Rejected("docs/config only", ", ".join(source[:5]))
    if not tests:
        raise Rejected("no test change")
    if not source:
        raise Rejected("no source change")
    if all(gitrepo.is_docs_or_config(p) for p in source):
        raise Rejected("docs/config only", ", ".join(source[:5]))
    lines = sum(c.added + c.deleted for c in changes)
    if len(changes) > opts.max_files or lines > opts.max_changed_lines:
        raise Rejected("too large", f"{len(changes)} files, {lines} lines")
    return tests, source


def decide(before: list[dict], after: list[dict]) -> tuple[list[str], list[str], list[str]]:
    """(FAIL_TO_PASS, PASS_TO_PASS, flaky) from per-run {node id: {"outcome"}} maps of each side.
    A run holding TIMED_OUT ended at its time limit: a test it did not report is "timeout" there,
    which decides nothing (never FAIL_TO_PASS)."""
    names = sorted({n for run in before + after for n in run} - {TIMED_OUT})

    def outcomes(runs: list[dict], name: str) -> set[str]:
        return {run.get(name, {}).get("outcome", "timeout" if TIMED_OUT in run else "absent") for run in runs}

    f2p, p2p, flaky = [], [], []
    for name in names:
        b, a = outcomes(before, name), outcomes(after, name)
        if len(b) > 1 or len(a) > 1:
            flaky.append(name)
        elif a == {"passed"} and b <= {"failed", "absent"}:  # an error is "failed" (tasks/verifier.py)
            f2p.append(name)
        elif a == {"passed"} and b == {"passed"}:
            p2p.append(name)
    return f2p, p2p, flaky


def sample(ids: list[str], limit: int = MAX_PASS_TO_PASS) -> list[str]:
    if len(ids) <= limit:
        return ids
    step = len(ids) / limit
    return [ids[int(i * step)] for i in range(limit)]


async def run_side(
    task: Task,
    lease: SandboxLease,
    source: Path,
    scratch: Path,
    limits: Limits,
    seed: int,
    *,
    solved: bool,
    env: BuiltEnv | None = None,
) -> dict:
    """One run of the task's verifier over a copy of `source`: {node id: {"outcome", "message"}}.

    On the solved side (`solved`), a run where no test ran (the test modules do not import, or
    pytest refused to start: an old conftest hook, an option it lacks) is the environment's
    fault: `Rejected` ("environment did not build"). Before the solution that is expected (a new
    test imports what the solution adds): its tests are absent."""
    job = await grader.prepare_job(task, lease, source, scratch, limits, diff=False, env=env)
    env_mounts, env_vars = grader.env_run_args(env)
    if task.config.pytest_plugins:  # the environment's own plugins, as the grader loads them
        env_vars = {**env_vars, "PYTEST_PLUGINS": ",".join(task.config.pytest_plugins)}
    try:
        if job.error is not None:
            raise Rejected("environment did not build", job.error)
        mounts = [Mount(job.app, "/app", True), Mount(job.logs, "/logs/verifier", True)]
        mounts += [Mount(task.tests_dir, "/tests", False), *env_mounts]
        argv = ["python3", "/tests/run_tests.py", "--outcomes", "/logs/verifier/outcomes.json"]
        argv += ["--hash-seed", str(seed), "--timeout", f"{limits.wall_seconds - 5:g}"]
        result = await lease.run(argv, mounts=mounts, cwd="/app", limits=limits, env=env_vars)
        raw = await asyncio.to_thread(grader.read_regular, job.logs, "outcomes.json", 64 * 2**20)
    finally:
        await asyncio.to_thread(grader.release_job, job.app)
    timed_out = result.timed_out or (raw is not None and json.loads(raw).get("timed_out", False))
    if timed_out and solved:
        raise Rejected("timed out", f"the tests after the change ran past {limits.wall_seconds:g} s")
    if timed_out:  # before the change: what it did not report is undecided (`decide`)
        return {**(json.loads(raw)["tests"] if raw is not None else {}), TIMED_OUT: {"outcome": "timeout"}}
    if raw is None:
        tail = (result.stderr or result.stdout)[-400:].strip()
        raise Rejected(
            "environment did not build", f"the test runner wrote no outcomes (exit {result.exit_code}): {tail}"
        )
    data = json.loads(raw)
    if solved and not data["tests"]:
        if data["collection_errors"]:
            path, message = next(iter(data["collection_errors"].items()))
            last = message.strip().splitlines()[-1] if message.strip() else ""
            raise Rejected("environment did not build", f"{path} does not import here: {last[:200]}")
        # no test and no module error: pytest itself stopped (a plugin or conftest it refuses, a bad option)
        tail = " | ".join(line for line in result.stdout.strip().splitlines()[-4:] if line.strip())
        raise Rejected("environment did not build", f"pytest ran no test after the change: {tail[-300:]}")
    return data["tests"]


class Miner:
    """Mines one repository into `out`; `run()` returns one `Outcome` per commit examined."""

    def __init__(self, repo: Path, out: Path, sandbox: Sandbox, opts: MineOptions, progress=None):
        self.repo, self.out, self.sandbox, self.opts = Path(repo), Path(out), sandbox, opts
        self.progress = progress
        self.name = gitrepo.remote_name(self.repo)
        self.scratch = Path(tempfile.mkdtemp(prefix="composer-jax-mine-"))
        self.limits = Limits(wall_seconds=opts.timeout_s, cpu_seconds=int(opts.timeout_s) + 1, memory_mb=4096)
        self.written = 0
        self.tests_run: set[str] = set()  # the commits whose tests reached the sandbox (`Outcome.tests_run`)
        self.reserved = 0  # tasks written or being written: never more than max_tasks

    async def run(self, commits: list[Commit] | None = None) -> list[Outcome]:
        if commits is None:
            commits = gitrepo.first_parent_commits(self.repo, self.opts.rev_range, self.opts.since, self.opts.until)
        sem = asyncio.Semaphore(max(1, self.opts.jobs))
        self.out.mkdir(parents=True, exist_ok=True)

        async def one(commit: Commit) -> Outcome | None:
            async with sem:
                if self._full():
                    return None
                outcome = await self.mine_commit(commit)
                if outcome is None:  # found a task when max_tasks were already written
                    return None
                if self.progress:
                    self.progress(outcome)
                return outcome

        try:
            results = await asyncio.gather(*(one(c) for c in commits))
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)
        return [r for r in results if r is not None]

    def _full(self) -> bool:
        return self.opts.max_tasks is not None and self.reserved >= self.opts.max_tasks

    async def mine_commit(self, commit: Commit) -> Outcome | None:
        start = time.monotonic()
        work = self.scratch / commit.sha
        try:
            outcome = await self._mine(commit, work)
        except _Enough:
            return None
        except Rejected as exc:
            outcome = Outcome(commit.sha, "rejected", exc.reason, exc.detail[:500])
        finally:
            await asyncio.to_thread(shutil.rmtree, work, True)
        outcome.seconds = round(time.monotonic() - start, 2)
        outcome.tests_run = commit.sha in self.tests_run
        return outcome

    async def _mine(self, commit: Commit, work: Path) -> Outcome:
        if commit.parent is None:
            raise Rejected("root commit")
        changes = await asyncio.to_thread(gitrepo.changed_files, self.repo, commit.parent, commit.sha)
        test_paths, source_paths = select(commit, changes, self.opts)
        draft, base, solved = await asyncio.to_thread(self._prepare, commit, changes, test_paths, source_paths, work)
        f2p, p2p, before, env = await self._find_tests(draft, base, solved)
        task = dataclasses.replace(
            with_pins(draft, env.installed if env is not None else ()),
            fail_to_pass=f2p,
            pass_to_pass=sample(p2p),
            pytest_plugins=list(pyenv.pytest_plugins(env)) if env is not None else [],
            category=category_of(commit, changes, before, f2p),
            extra_metadata={
                **draft.extra_metadata,
                **({"pass_to_pass_total": len(p2p)} if len(p2p) > MAX_PASS_TO_PASS else {}),
            },
        )
        files = work / "draft" / draft.task_id / "tests" / "files"
        task.instruction = write_instruction(commit, task, before, self.opts.writer, files)
        await self._write(task, base)
        return Outcome(commit.sha, "written", task_id=task.task_id, fail_to_pass=f2p, pass_to_pass=task.pass_to_pass)

    async def _write(self, task: RepoTask, base: Path) -> Path:
        """Write and validate `task`, within max_tasks: jobs in flight together find tasks at once,
        and only the first max_tasks of them write (`--max-tasks` is exact); `_Enough` for the rest.
        A task whose oracle fails frees its slot."""
        if self._full():
            raise _Enough
        self.reserved += 1  # no await since the check: no other job can take the same slot
        try:
            final = await asyncio.to_thread(write_task, task, base, self.out)
            problem = await validate.check_written(final, self.sandbox, self.scratch, self.limits, self.opts.env_cache)
        except BaseException:
            self.reserved -= 1
            raise
        if problem:
            self.reserved -= 1
            await asyncio.to_thread(shutil.rmtree, final, True)
            raise Rejected("oracle failed", problem)
        self.written += 1
        return final

    def _prepare(
        self, commit: Commit, changes: list[FileChange], tests: list[str], source: list[str], work: Path
    ) -> tuple[RepoTask, Path, Path]:
        """The draft task (no tests decided yet) and the trees before and after the solution."""
        assert commit.parent is not None
        base, solved = work / "base", work / "solved"
        gitrepo.write_tree(self.repo, commit.parent, base)
        dated = self.opts.dated and self.opts.env_cache is not None
        try:
            project = projectenv.project_environment(self.repo, commit.sha, commit.date if dated else None)
        except gitrepo.DependencyGroupError as exc:
            raise Rejected("environment did not build", str(exc)) from None
        projectenv.write_generated(base, project)  # before the copy: both sides have it
        test_patch = gitrepo.diff(self.repo, commit.parent, commit.sha, tests)
        solution_patch = gitrepo.diff(self.repo, commit.parent, commit.sha, source)
        shutil.copytree(base, solved, symlinks=True)
        try:
            gitrepo.apply(base, test_patch, check_only=True)
            gitrepo.apply(solved, solution_patch)
        except GitError as exc:
            raise Rejected("patch does not apply", str(exc)) from None
        removed = {c.path for c in changes if c.status == "D"}
        modules = [p for p in tests if gitrepo.is_test_module(p) and p not in removed]
        if not modules:
            raise Rejected("no test module", "the test change touches no test_*.py / *_test.py module")
        short = commit.sha[:8]
        draft = RepoTask(
            task_id=harness_safe(f"{self.name.replace('/', '__')}-{short}"),
            instance_id=harness_safe(f"{self.name.replace('/', '__')}-{short}"),
            repo=self.name,
            base_commit=commit.parent,
            solution_commit=commit.sha,
            commit_date=commit.date,
            category="bug fix",
            instruction=commit.subject or "(no message)",
            test_patch=test_patch,
            solution_patch=solution_patch,
            test_files=modules,
            changed_files=len(changes),
            changed_lines=sum(c.added + c.deleted for c in changes),
            verifier_timeout_s=self.opts.timeout_s,
            environment=project.environment(),
            extra_metadata={"install_rule": project.install_rule} if project.install_rule else {},
        )
        write_task(draft, base, work / "draft")
        return draft, base, solved

    async def _find_tests(
        self, draft: RepoTask, base: Path, solved: Path
    ) -> tuple[list[str], list[str], dict, BuiltEnv | None]:
        """(FAIL_TO_PASS, PASS_TO_PASS, the first before-run's outcomes, the environment they ran
        in) over `runs` runs a side."""
        try:
            task = load_task(base.parent / "draft" / draft.task_id)
        except TaskError as exc:
            raise Rejected("environment did not build", str(exc)) from None
        env = await self._environment(task)
        if env is not None and (plugins := pyenv.pytest_plugins(env)):
            task = dataclasses.replace(task, config=dataclasses.replace(task.config, pytest_plugins=plugins))
        assert draft.solution_commit is not None  # a mined task: the commit it was mined from
        self.tests_run.add(draft.solution_commit)
        lease = self.sandbox.lease(f"mine-{draft.task_id}-{time.monotonic_ns()}")
        before: list[dict] = []
        after: list[dict] = []
        try:
            for i in range(self.opts.runs):
                before.append(
                    await run_side(task, lease, base, self.scratch, self.limits, seed=i + 1, solved=False, env=env)
                )
                after.append(
                    await run_side(task, lease, solved, self.scratch, self.limits, seed=i + 1, solved=True, env=env)
                )
                f2p, p2p, flaky = decide(before, after)
                # Nothing can still become FAIL_TO_PASS: every test after passed or is decided.
                if not f2p and not flaky and all(r["outcome"] == "passed" for r in after[-1].values()):
                    break
        finally:
            await lease.close()
        if not f2p:
            detail = f"flaky: {', '.join(flaky[:5])}" if flaky else f"{len(after[-1])} tests ran after the change"
            if any(TIMED_OUT in run for run in before):
                detail += "; the run before the change timed out (its unreported tests decide nothing)"
            raise Rejected("flaky" if flaky else "no FAIL_TO_PASS", detail)
        return f2p, p2p, before[0], env

    async def _environment(self, task: Task) -> BuiltEnv | None:
        """The task's declared environment, built once per distinct spec (`Rejected` when it cannot be)."""
        if task.config.environment is None:
            return None
        wanted = ", ".join(task.config.environment.requirements)
        if self.opts.env_cache is None:
            raise Rejected("environment did not build", f"the project needs {wanted}; give --wheelhouse or --index-url")
        try:
            return await for_task(self.opts.env_cache, task)
        except EnvBuildError as exc:
            raise Rejected("environment did not build", f"{wanted}: {exc.reason} {exc.log_tail[-300:]}") from None


def summary(name: str, outcomes: list[Outcome]) -> dict:
    """The yield of a mining run: commits examined, candidates (commits whose diff qualifies: not
    rejected for a `SELECTION_REASONS`), those whose tests ran in the sandbox, tasks written, and
    rejections by reason (in `REASONS` order)."""
    reasons = Counter(o.reason for o in outcomes if o.status == "rejected")
    return {
        "repo": name,
        "commits_seen": len(outcomes),
        "candidates": sum(o.status == "written" or o.reason not in SELECTION_REASONS for o in outcomes),
        "tests_run": sum(o.tests_run for o in outcomes),
        "written": sum(o.status == "written" for o in outcomes),
        "rejected": {r: reasons[r] for r in REASONS if reasons[r]},
    }


def format_summary(s: dict) -> str:
    lines = [
        f"{s['repo']}: {s['commits_seen']} commits seen, {s['candidates']} candidates, "
        f"{s['tests_run']} run in the sandbox, {s['written']} tasks written"
    ]
    lines += [f"  rejected  {n:>5}  {reason}" for reason, n in s["rejected"].items()]
    lines += source_problem_lines(s.get("package_source_problems", {}))
    return "\n".join(lines)
