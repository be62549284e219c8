"""Grading the agent's change with the task's verifier, and the oracle run used by `env validate`.

Grading (Harbor's verifier contract, run locally, on the agent's patch as SWE-bench grades): a
fresh copy of the task's pristine workspace gets the agent's change carried onto it as a text patch
(`snapshot.py`: regular text files only; what is not carried is named in `excluded`), and the
patch's Python is read for levers on the test runner (`levers.py`: any -> reward 0, `tampering`,
and the tests do not run). The copy is mounted at /app (read-write); the task's tests/ at /tests
(read-only); a fresh empty directory at /logs/verifier (read-write). `bash /tests/test.sh` runs
with cwd /app. A task whose verifier is this project's (`tasks/verifier.py`) is paid from its
per-test verdicts (/logs/verifier/verdicts.json, `verifier.decide`), never from an exit status;
any other is read as Harbor reads it: reward.json first (numbers only), else reward.txt, with
per-test results from junit.xml when the tests wrote one. The agent's workspace itself is never
touched by grading, so a session can be graded many times.

Nothing here walks agent-controlled paths as root: the copy and the diff run inside the session's
sandbox as its uid (`snapshot.py`, by descriptors, with a time and output budget), and the reward
files are read by descriptor (`O_NOFOLLOW | O_NONBLOCK`, regular files only) off the event loop.
The grade response says which `python3` the sandbox has (`interpreter`).
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import hashlib
import json
import math
import os
import stat
import time
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

from composer_jax.env.sandbox import snapshot, volumes
from composer_jax.env.sandbox.pyenv import BuiltEnv
from composer_jax.env.sandbox.runner import ExecResult, Limits, Mount, SandboxLease
from composer_jax.env.tasks import tampering as tampering_mod
from composer_jax.env.tasks import verifier
from composer_jax.env.tasks.store import Task

MAX_DIFF_BYTES = 256 * 1024
SNAPSHOT_TIMEOUT_S = 120.0  # wall clock (and CPU seconds) for copying and diffing a workspace
_SNAPSHOT_SOURCE = Path(snapshot.__file__).read_text()


@dataclasses.dataclass
class GradeResult:
    reward: float
    tests: list[dict]  # [{"name", "outcome": passed|failed|error|skipped, "message"}]
    diff: str  # unified diff from the task's initial workspace to the graded one
    error: str | None  # why the reward is 0 without the tests deciding it, if so
    exit_code: int | None
    timed_out: bool
    output_tail: str  # the verifier's last stdout/stderr, for debugging tasks
    duration_s: float
    reward_details: dict = dataclasses.field(default_factory=dict)
    interpreter: dict = dataclasses.field(default_factory=dict)  # {python, version}: the sandbox's python3
    environment: dict = dataclasses.field(default_factory=dict)  # the task's built env ({key, python, ...}) or {}
    # What the change did to grading (tasks/tampering.py): [{path, class, action, ...}]; any -> reward 0.
    tampering: list = dataclasses.field(default_factory=list)
    # What the grade did not carry from the workspace: [{path, class}] (no penalty; tampering.EXCLUDED).
    excluded: list = dataclasses.field(default_factory=list)
    cached: bool = False  # the verdict of an earlier grade of an equal carried change (GradeCache)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def read_regular(logs: Path, name: str, limit: int) -> bytes | None:
    """Up to `limit` bytes of the regular file `logs/name`, opened by descriptor without following
    symlinks or blocking on FIFOs; None when absent. ValueError when it is not a regular file."""
    dfd = os.open(logs, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ValueError(f"{name} is not a regular file") from exc
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"{name} is not a regular file")
            return f.read(limit)
    finally:
        os.close(dfd)


def _numeric(value: object) -> bool:
    # Harbor's test: an int or float (so JSON true/false pass, as in Harbor), and finite.
    return isinstance(value, (int, float)) and math.isfinite(value)


def read_reward(logs: Path, json_trusted: bool = True) -> tuple[float | None, dict, str | None]:
    """(reward, other rewards, error) from `logs`, as Harbor reads them: reward.json when it exists
    (a number, or an object whose values are all finite numbers: its "reward", or its only value;
    the other values are returned as details), else reward.txt (one finite number). Without
    `json_trusted` (the task's verifier does not write reward.json) only reward.txt is read."""
    try:
        js = read_regular(logs, "reward.json", 100_000) if json_trusted else None
        txt = read_regular(logs, "reward.txt", 1000) if js is None else None
    except ValueError as exc:
        return None, {}, str(exc)
    if js is not None:
        try:
            data = json.loads(js.decode("utf-8", "replace"))
        except ValueError as exc:
            return None, {}, f"reward.json is not JSON: {exc}"
        if not isinstance(data, dict):
            data = {"reward": data}
        bad = {k: v for k, v in data.items() if not _numeric(v)}
        if bad or not data:
            shown = ", ".join(f"{k}={v!r:.40}" for k, v in list(bad.items())[:5]) or "an empty object"
            return None, {}, f"reward.json values must all be finite numbers (Harbor's rule); got {shown}"
        if "reward" not in data and len(data) > 1:
            return None, {}, f'reward.json has several values ({", ".join(sorted(data))}) and no "reward"'
        key = "reward" if "reward" in data else next(iter(data))
        return float(data[key]), {k: v for k, v in data.items() if k != key}, None
    if txt is not None:
        raw = txt.decode("utf-8", "replace").strip()
        try:
            reward = float(raw)
        except ValueError:
            return None, {}, f"reward.txt holds {raw[:80]!r}, not a number"
        return (reward, {}, None) if math.isfinite(reward) else (None, {}, f"reward.txt holds {raw!r}")
    return None, {}, "the verifier wrote neither /logs/verifier/reward.json nor reward.txt"


def parse_junit(path: Path) -> list[dict]:
    """Per-test outcomes from a JUnit XML file (pytest --junitxml); [] when absent or unreadable."""
    try:
        data = read_regular(path.parent, path.name, 8 * 2**20 + 1)
    except (ValueError, OSError):
        return []
    if data is None or len(data) > 8 * 2**20:
        return []
    try:
        root = ET.fromstring(data)
    except ET.ParseError:
        return []
    tests = []
    for case in root.iter("testcase"):
        name = "::".join(x for x in (case.get("classname"), case.get("name")) if x)
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or child.text or "")[:2000]
                break
        tests.append({"name": name, "outcome": outcome, "message": message})
    return tests


def workspace_diff(before: Path | None, after: Path) -> str:
    """Unified diff (a/ = `before`, b/ = `after`), capped at MAX_DIFF_BYTES, walked by descriptors.

    Only for trusted trees in the server process; grading diffs inside the sandbox (`snapshot`)."""
    out: list[str] = []
    ofd = os.open(before, os.O_RDONLY | os.O_DIRECTORY) if before is not None and before.is_dir() else None
    nfd = os.open(after, os.O_RDONLY | os.O_DIRECTORY)
    try:
        snapshot.diff(ofd, nfd, MAX_DIFF_BYTES, out.append)
    finally:
        os.close(nfd)
        if ofd is not None:
            os.close(ofd)
    return "".join(out)


@dataclasses.dataclass
class Job:
    """A grading or oracle copy: `dir` holds the `app` and `logs` volumes; free it with `release_job`."""

    dir: Path
    diff: str = ""
    error: str | None = None
    interpreter: dict = dataclasses.field(default_factory=dict)
    excluded: list = dataclasses.field(default_factory=list)  # what the carry left out (snapshot.py)
    levers: list = dataclasses.field(default_factory=list)  # what the lever scanner found (levers.py)
    carried_sha256: str = ""  # every deletion and write carried (snapshot.py): the graded tree's identity

    @property
    def app(self) -> Path:
        return self.dir / "app"

    @property
    def logs(self) -> Path:
        return self.dir / "logs"


def _new_job(task: Task, lease: SandboxLease, scratch_root: Path) -> Job:
    job = Job(scratch_root / f"job-{uuid.uuid4().hex[:12]}")
    job.dir.mkdir(parents=True, mode=0o700)
    try:
        volumes.create_volume(job.app, task.config.storage_mb, lease.uid, lease.gid)
        volumes.create_volume(job.logs, 64, lease.uid, lease.gid)
    except BaseException:
        volumes.remove_tree(job.dir)
        raise
    return job


def env_run_args(env: BuiltEnv | None) -> tuple[list[Mount], dict[str, str]]:
    """The mounts and variables that put a task's built environment first on PATH ([] and {} for none)."""
    return ([env.mount()], env.env_vars()) if env is not None else ([], {})


async def prepare_job(
    task: Task,
    lease: SandboxLease,
    source: Path,
    scratch_root: Path,
    limits: Limits,
    *,
    diff: bool,
    env: BuiltEnv | None = None,
) -> Job:
    """A fresh job whose app volume holds, made inside the sandbox as the session's uid
    (`snapshot`): with `diff`, the task's pristine workspace with the change from it to `source`
    carried (and that change's diff, `excluded` and `levers`); else a plain copy of `source`.

    A copy that fails or runs out of its budget sets `job.error` (the job is still returned);
    the caller always frees the job with `release_job`, which this does itself on an exception."""
    job = await asyncio.to_thread(_new_job, task, lease, scratch_root)
    try:
        mounts = [Mount(source, "/src", False), Mount(job.app, "/app", True)]
        tail: list[str] = []
        if diff:
            pristine = task.app_dir if task.app_dir.is_dir() else scratch_root / "empty"
            pristine.mkdir(exist_ok=True)
            mounts.append(Mount(pristine, "/orig", False))
            policy = json.dumps(tampering_mod.grade_policy(task))
            tail = [lease.path_in_sandbox(mounts[-1]), str(MAX_DIFF_BYTES), policy, tampering_mod.LEVERS_SOURCE]
            tail += task.config.test_modules
        else:
            tail = ["", "0"]
        argv = ["python3", "-I", "-c", _SNAPSHOT_SOURCE, lease.path_in_sandbox(mounts[0])]
        argv += [lease.path_in_sandbox(mounts[1]), *tail]
        snap_limits = limits.with_(
            wall_seconds=SNAPSHOT_TIMEOUT_S,
            cpu_seconds=int(SNAPSHOT_TIMEOUT_S),
            output_bytes=MAX_DIFF_BYTES + 65536,
        )
        env_mounts, env_vars = env_run_args(env)  # so `interpreter` and python_modules are the env's
        result = await lease.run(argv, mounts=mounts + env_mounts, cwd="/app", limits=snap_limits, env=env_vars)
        job.diff = result.stdout
        facts = _last_json_line(result.stderr)
        job.interpreter = {k: facts[k] for k in ("python", "version") if k in facts}
        job.excluded, job.levers = list(facts.get("excluded", [])), list(facts.get("levers", []))
        job.carried_sha256 = str(facts.get("carried_sha256", ""))
        if result.timed_out:
            job.error = f"copying the workspace took over {SNAPSHOT_TIMEOUT_S:g}s; the tests did not run"
        elif result.exit_code != 0 or not facts:
            job.error = f"copying the workspace failed (exit {result.exit_code}): {result.stderr[-500:].strip()}"
        elif facts.get("missing"):
            job.error = (
                f"the sandbox's python3 ({facts.get('python')} {facts.get('version')}) cannot import "
                f"{', '.join(facts['missing'])}, which task.toml [verifier] python_modules declares; "
                "the tests did not run (install them in the server's Python environment)"
            )
        return job
    except BaseException:
        await asyncio.to_thread(release_job, job.app)
        raise


def _last_json_line(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        return value if isinstance(value, dict) else {}
    return {}


def release_job(app: Path) -> None:
    """Unmount and delete a job (given its app directory); safe to call twice."""
    volumes.remove_tree(app.parent)


def _failed(job: Job, start: float, environment: dict, error: str, tampering: list | None = None) -> GradeResult:
    """A grade whose tests did not run (or ran on a tampered workspace): reward 0 with `error`."""
    return GradeResult(
        reward=0.0,
        tests=[],
        diff=job.diff,
        error=error,
        exit_code=None,
        timed_out=False,
        output_tail="",
        duration_s=round(time.monotonic() - start, 4),
        interpreter=job.interpreter,
        environment=environment,
        tampering=tampering or [],
        excluded=job.excluded,
    )


def task_fingerprint(task: Task) -> list:
    """The task's files as they are on disk now (path, size, mtime of everything under its folder:
    the pristine workspace, the tests, task.toml): a task edited on disk is another task to the cache."""
    out: list = []
    for root, dirs, files in os.walk(task.root):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            out.append((os.path.relpath(path, task.root), st.st_size, st.st_mtime_ns, st.st_mode))
    return [str(task.root), out]


class GradeCache:
    """The verdicts of earlier grades by what was graded (`--grade-cache N` of `composer-jax
    env-server`; off by default): a grade is a function of the task (its pristine workspace, tests and
    verifier), its built environment and the tree the carry made, and that tree is the pristine one
    with exactly the deletions and writes `carried_sha256` hashes (path, mode, bytes; snapshot.py).
    So a second grade of an equal change in a session of the same task (in RL, the rollouts of one
    group that made the same edit) is answered with the first one's verdict (reward, tests,
    details), without running the tests again; what it did not carry (`excluded`) and its diff are
    its own. Only a verdict the tests gave is kept: no copy error, no lever, no tampering, no
    timeout. Least recently used entries go first beyond `capacity`."""

    def __init__(self, capacity: int):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"grade cache capacity {capacity!r}: expected an integer >= 1 (entries)")
        self.capacity = capacity
        self._entries: collections.OrderedDict[str, GradeResult] = collections.OrderedDict()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def key(task: Task, job: Job, environment: dict) -> str | None:
        """The cache key of a grade of `job` (None: not cacheable, the carry gave no tree hash)."""
        if not job.carried_sha256:
            return None
        what = [task.task_id, task_fingerprint(task), job.carried_sha256, environment]
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()

    def get(self, key: str) -> GradeResult | None:
        found = self._entries.get(key)
        if found is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return copy.deepcopy(found)

    def put(self, key: str, result: GradeResult) -> None:
        if result.error is not None or result.timed_out or result.tampering:
            return
        self._entries[key] = copy.deepcopy(result)
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)


async def grade(
    task: Task,
    lease: SandboxLease,
    workspace: Path,
    scratch_root: Path,
    limits: Limits,
    env: BuiltEnv | None = None,
    cache: GradeCache | None = None,
) -> GradeResult:
    """Run the task's verifier on the task's pristine workspace with the change in `workspace`
    carried onto it (see module docstring), with the task's built Python environment `env`
    (pyenv.py) first on PATH when it has one; with a `cache`, an equal carried change of the same
    task graded before is answered with that grade's verdict (`GradeCache`).

    The carry, the lever scan and the diff run inside the sandbox as the session's uid; a change
    with a lever scores 0 without running the tests; reward files are read by descriptor off the
    event loop; the job's volumes are released on every path."""
    start = time.monotonic()
    job = await prepare_job(task, lease, workspace, scratch_root, limits, diff=True, env=env)
    environment = env.describe() if env is not None else {}
    env_mounts, env_vars = env_run_args(env)
    key = None
    try:
        if job.error is not None:
            return _failed(job, start, environment, job.error)
        if job.levers:
            tampering = tampering_mod.lever_entries(job.levers)
            return _failed(job, start, environment, tampering_mod.tampering_error(tampering), tampering)
        # (the key walks the task's folder: off the event loop)
        key = await asyncio.to_thread(GradeCache.key, task, job, environment) if cache is not None else None
        if cache is not None and key is not None and (known := cache.get(key)) is not None:
            # the verdict is the earlier grade's; the record of what this change was is this one's
            known.diff, known.excluded, known.interpreter = job.diff, job.excluded, job.interpreter
            known.duration_s, known.cached = time.monotonic() - start, True
            return known
        result, reward, details, error, tests, tampering = await _verify(task, lease, job, limits, env_mounts, env_vars)
    finally:
        await asyncio.to_thread(release_job, job.app)
    if tampering:
        error, reward, details = tampering_mod.tampering_error(tampering), 0.0, {}
    tail = result.stdout[-4000:] + ("\n--- stderr ---\n" + result.stderr[-4000:] if result.stderr else "")
    graded = GradeResult(
        reward=reward if reward is not None else 0.0,
        tests=tests,
        diff=job.diff,
        error=error if reward is None or result.timed_out or tampering else None,
        exit_code=result.exit_code,
        timed_out=result.timed_out,
        output_tail=tail,
        duration_s=result.duration_s,
        reward_details=details,
        interpreter=job.interpreter,
        environment=environment,
        tampering=tampering,
        excluded=job.excluded,
    )
    if cache is not None and key is not None:
        cache.put(key, graded)
    return graded


async def _verify(
    task: Task, lease: SandboxLease, job: Job, limits: Limits, env_mounts: list[Mount], env_vars: dict[str, str]
) -> tuple[ExecResult, float | None, dict, str | None, list[dict], list[dict]]:
    """Run `bash /tests/test.sh` on the job: (result, reward, details, error, tests, tampering)."""
    verifier_limits = limits.with_(
        wall_seconds=task.config.verifier_timeout_sec,
        cpu_seconds=max(limits.cpu_seconds, int(task.config.verifier_timeout_sec) + 1),
    )
    mounts = [Mount(job.app, "/app", True), Mount(job.logs, "/logs/verifier", True)]
    mounts += [Mount(task.tests_dir, "/tests", False), *env_mounts]
    run_env = {**tampering_mod.verifier_env(task), **env_vars}
    result = await lease.run(["bash", "/tests/test.sh"], mounts=mounts, cwd="/app", limits=verifier_limits, env=run_env)
    tampering = await asyncio.to_thread(_forged_rewards, task, job.logs)
    if tampering_mod.verdicts_expected(task):
        reward, details, error, tests, forged = await asyncio.to_thread(read_verdicts, job.logs)
        tampering += forged
    else:
        trusted = tampering_mod.reward_json_trusted(task)
        reward, details, error = await asyncio.to_thread(read_reward, job.logs, trusted)
        tests = await asyncio.to_thread(parse_junit, job.logs / "junit.xml")
    if result.timed_out:
        error = f"verifier timed out after {task.config.verifier_timeout_sec}s" + (
            f"; {error}" if error and reward is None else ""
        )
    return result, reward, details, error, tests, tampering


def read_verdicts(logs: Path) -> tuple[float | None, dict, str | None, list[dict], list[dict]]:
    """(reward, details, error, tests, tampering) from the verifier's verdicts.json: the reward is
    `verifier.decide`'s over the per-test verdicts (never the exit status or reward.txt)."""
    try:
        raw = read_regular(logs, "verdicts.json", 64 * 2**20)
    except ValueError as exc:
        return None, {}, str(exc), [], []
    try:
        verdicts = json.loads(raw) if raw is not None else None
    except ValueError:
        verdicts = None
    if not isinstance(verdicts, dict) or verdicts.get("format") != verifier.FORMAT:
        return None, {}, "the verifier wrote no verdicts (/logs/verifier/verdicts.json)", [], []
    reward, why = verifier.decide(verdicts)
    results = verdicts.get("tests", {})
    tests = [
        {"name": name, "outcome": v.get("outcome", ""), "message": str(v.get("message", ""))[:2000]}
        for name, v in (results.items() if isinstance(results, dict) else [])
        if isinstance(v, dict)
    ]
    details = {"graded": len(verdicts.get("graded", [])), "passed": sum(t["outcome"] == "passed" for t in tests)}
    forged = []
    if verdicts.get("forged"):
        forged = [{"path": "/logs/verifier/verdicts.json", "class": "verdict-forge", "action": "refused"}]
    return reward, details, (None if reward == 1.0 else why), tests, forged


def _forged_rewards(task: Task, logs: Path) -> list[dict]:
    """A reward.json the task's verifier does not write: the tests wrote it (class "reward-write")."""
    if tampering_mod.reward_json_trusted(task):
        return []
    try:
        os.lstat(logs / "reward.json")
    except OSError:
        return []
    return [{"path": "/logs/verifier/reward.json", "class": "reward-write", "action": "ignored"}]


async def oracle_workspace(
    task: Task, lease: SandboxLease, scratch_root: Path, limits: Limits, env: BuiltEnv | None = None
) -> tuple[Path, ExecResult]:
    """Run solution/solve.sh on a fresh copy of the initial workspace; returns (solved dir, result).

    The caller grades the returned directory and then frees it with `release_job`."""
    empty = scratch_root / f"empty-{uuid.uuid4().hex[:12]}"
    source = task.app_dir if task.app_dir.is_dir() else empty
    empty.mkdir(parents=True, mode=0o755, exist_ok=True)
    try:
        job = await prepare_job(task, lease, source, scratch_root, limits, diff=False, env=env)
    finally:
        empty.rmdir()
    try:
        if job.error is not None:
            raise RuntimeError(f"task {task.task_id!r}: {job.error}")
        solve_limits = limits.with_(wall_seconds=task.config.agent_timeout_sec)
        mounts = [Mount(job.app, "/app", True), Mount(job.logs, "/logs/verifier", True)]
        env_mounts, env_vars = env_run_args(env)
        mounts += [Mount(task.solution_dir, "/solution", False), *env_mounts]
        result = await lease.run(
            ["bash", "/solution/solve.sh"], mounts=mounts, cwd="/app", limits=solve_limits, env=env_vars
        )
        await asyncio.to_thread(volumes.remove_tree, job.logs)
    except BaseException:
        await asyncio.to_thread(release_job, job.app)
        raise
    return job.app, result
