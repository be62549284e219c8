"""Sessions: one task instance with its own workspace, sandbox identity, tools and TTL.

`SessionManager` owns every session of a server: creation (bounded by `max_sessions`, beyond
which `CapacityError` becomes HTTP 429), lookup, tool calls, grading, closing, and a reaper that
closes sessions idle for longer than their TTL. A session's state is its workspace directory and
this object; what its processes do (crash, fork-bomb, fill their disk) stays inside its sandbox
and volume, so other sessions and the server keep their state.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import tempfile
import time
from pathlib import Path

from composer_jax.env.api import protocol
from composer_jax.env.api.errors import (
    CapacityError,
    SessionBusy,
    SessionNotFound,
    TaskError,
    TaskNotRunnable,
)
from composer_jax.env.sandbox import volumes
from composer_jax.env.sandbox.pyenv import BuiltEnv, EnvBuildError, EnvCache
from composer_jax.env.sandbox.runner import ExecResult, Limits, Mount, Sandbox, SandboxLease
from composer_jax.env.sandbox.workspace import Workspace
from composer_jax.env.server.metrics import EnvMetrics
from composer_jax.env.tasks import grader
from composer_jax.env.tasks.store import MAX_SEED, Task, TaskStore, check_seed
from composer_jax.env.tools import agent_tools as tools
from composer_jax.env.tools.web_search import Backend, WebTools, task_wants_web

log = logging.getLogger(__name__)


class Session:
    """One open session; implements `tools.ToolContext`."""

    def __init__(
        self,
        session_id: str,
        task: Task,
        seed: int,
        root: Path,
        lease: SandboxLease,
        limits: Limits,
        ttl_s: float,
        web: Backend | None = None,
    ):
        self.session_id, self.task, self.seed = session_id, task, seed
        # The tools this session offers: the base six, and the web tools when its task (or the
        # server's --web-search-offer all) allows them; others are unknown tools here.
        self.web = web
        self.tool_names = protocol.session_tool_names(web is not None)
        self.root, self.lease, self.limits, self.ttl_s = root, lease, limits, ttl_s
        self.workspace = Workspace(root / "app", lease.uid, lease.gid)
        self.created_at = self.last_used = time.time()
        self.tool_calls = 0
        self.grades = 0
        self.last_reward: float | None = None
        self.busy = 0  # requests in flight; the reaper never closes a busy session
        # Tool calls and grading are serialised: a grade waits for the calls in flight (`idle`)
        # and refuses new ones (SessionBusy, HTTP 409) until it has returned (`not_grading`).
        self.calls_in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.grading = False
        self.not_grading = asyncio.Event()
        self.not_grading.set()
        self.closed = False
        # OpenEnv episode bookkeeping, shared by the WebSocket and /mcp (openenv_ws.py, mcp.py):
        # the client's episode id (else the session id), steps taken, whether it was submitted, and
        # whether a socket is attached to a session created over /mcp.
        self.episode_id = session_id
        self.step_count = 0
        self.done = False
        self.attached = False
        self.env: BuiltEnv | None = None  # the task's built Python environment (pyenv.py)

    async def run_shell(self, command: str, timeout_s: float) -> ExecResult:
        limits = self.limits.with_(wall_seconds=min(float(timeout_s), self.limits.wall_seconds))
        env_mounts, env_vars = grader.env_run_args(self.env)
        return await self.lease.run(
            ["bash", "-c", command],
            mounts=[Mount(self.workspace.root, "/app", True), *env_mounts],
            cwd="/app",
            limits=limits,
            env=env_vars,
        )

    def state(self) -> dict:
        return {
            "session_id": self.session_id,
            "task_id": self.task.task_id,
            "seed": self.seed,
            "created_at": self.created_at,
            "last_used": self.last_used,
            "ttl_s": self.ttl_s,
            "expires_at": self.last_used + self.ttl_s,
            "tool_calls": self.tool_calls,
            "grades": self.grades,
            "last_reward": self.last_reward,
            "episode_id": self.episode_id,
            "step_count": self.step_count,
            "done": self.done,
        }


class SessionManager:
    def __init__(
        self,
        store: TaskStore,
        sandbox: Sandbox,
        *,
        work_dir: Path | None = None,
        max_sessions: int = 256,
        default_ttl_s: float = 1800.0,
        max_ttl_s: float = 86400.0,
        limits: Limits | None = None,
        metrics: EnvMetrics | None = None,
        env_cache: EnvCache | None = None,
        web_tools: WebTools | None = None,
        grade_cache: grader.GradeCache | None = None,
    ):
        self.store, self.sandbox = store, sandbox
        self.grade_cache = grade_cache  # None: every grade runs the tests (env-server --grade-cache)
        self.env_cache = env_cache  # built task environments; looked up, never built, per session
        self.web_tools = web_tools  # None: no session is offered web_search/read_page
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix="composer-jax-env-"))
        self._own_work_dir = work_dir is None
        if work_dir is None:
            # Mounts and scratch directories a killed server left behind in the temp dir.
            volumes.sweep_dead(self.work_dir.parent, "composer-jax-env-")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.work_dir, 0o700)  # other host users must not browse workspaces
        self._work_dir_lock: int | None = volumes.hold_work_dir(self.work_dir)
        self.sessions_dir = self.work_dir / "sessions"
        volumes.remove_tree(self.sessions_dir)  # what a killed server left in a reused --work-dir
        self.sessions_dir.mkdir()
        self.max_sessions, self.default_ttl_s, self.max_ttl_s = max_sessions, default_ttl_s, max_ttl_s
        self.limits = limits or Limits()
        self.metrics = metrics or EnvMetrics()
        # open sessions, the backend's sandboxed commands and the built environments: read at scrape time
        self.metrics.watch(lambda: len(self._sessions), sandbox.stats, lambda: self.env_cache)
        self._sessions: dict[str, Session] = {}
        self._reserved = 0
        self._reaper: asyncio.Task | None = None

    # ---------------------------------------------------------------- lifecycle
    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        """Whether `session_id` is open; unlike `get`, not a use (its TTL is not renewed)."""
        return session_id in self._sessions

    def resolve_task(self, task_id: str | None, seed: int | None) -> tuple[str, int]:
        """(task id, seed) a session is created with. Without a task id (OpenEnv's bare reset) the
        task is picked by the seed, drawn at random when not given either; with one, seed defaults to 0."""
        if task_id is None:
            seed = secrets.randbelow(MAX_SEED + 1) if seed is None else check_seed(seed)
            return self.store.pick(seed), seed
        return task_id, 0 if seed is None else seed

    async def create(
        self,
        task_id: str | None,
        seed: int | None = None,
        ttl_s: float | None = None,
        *,
        session_id: str | None = None,
        episode_id: str | None = None,
    ) -> Session:
        """A new session of `task_id` (picked by the seed when None: `resolve_task`); `session_id`
        reuses an id (a reset), `episode_id` is the client's name for the episode."""
        start = time.monotonic()
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= self.max_ttl_s:
            raise TaskError(f"ttl_s {ttl_s!r} must be a number in (0, {self.max_ttl_s}]")
        if episode_id is not None and (not isinstance(episode_id, str) or not 0 < len(episode_id) <= 256):
            raise TaskError(f"episode_id {episode_id!r:.80} must be a string of 1 to 256 characters")
        task_id, seed = self.resolve_task(task_id, seed)
        task = await asyncio.to_thread(self.store.get, task_id, seed)  # may generate a task
        if not task.runnable:
            raise TaskNotRunnable(f"task {task_id!r} cannot run in the local sandbox: {task.not_runnable_reason}")
        env = self._task_env(task)
        web = self.web_for(task)
        if len(self._sessions) + self._reserved >= self.max_sessions:
            self.metrics.sessions_rejected.inc()
            raise CapacityError(
                f"server is at its limit of {self.max_sessions} concurrent sessions; "
                "close a session or retry later / on another server"
            )
        if session_id is not None and session_id in self._sessions:
            raise TaskError(f"session {session_id!r} is open; close it before reusing its id")
        self._reserved += 1
        session_id = session_id or secrets.token_hex(12)
        root = self.sessions_dir / session_id
        lease = self.sandbox.lease(session_id)
        try:
            root.mkdir(mode=0o700)
            await asyncio.to_thread(self._materialise, task, root, lease)
            session = Session(session_id, task, seed, root, lease, self.limits, float(ttl), web)
            session.episode_id = episode_id or session_id
            session.env = env
            self._sessions[session_id] = session
        except BaseException:
            await lease.close()
            await asyncio.to_thread(self._remove_root, root)
            raise
        finally:
            self._reserved -= 1
        self.metrics.sessions_created.inc()
        self.metrics.session_create_seconds.observe(time.monotonic() - start)
        return session

    def _task_env(self, task: Task) -> BuiltEnv | None:
        """The task's built Python environment (None when it declares none); TaskNotRunnable when
        it was not built (the server builds them at start-up) or its build failed."""
        if task.config.environment is None:
            return None
        if self.env_cache is None:
            raise TaskNotRunnable(f"task {task.task_id!r} declares a Python environment; this server has no env cache")
        try:
            return self.env_cache.lookup(task.config.environment, task.app_dir)
        except EnvBuildError as exc:
            raise TaskNotRunnable(f"task {task.task_id!r}: {exc}") from None

    @staticmethod
    def _materialise(task: Task, root: Path, lease: SandboxLease) -> None:
        app = root / "app"
        volumes.create_volume(app, task.config.storage_mb, lease.uid, lease.gid)
        volumes.copy_tree(task.app_dir, app, lease.uid, lease.gid)

    @staticmethod
    def _remove_root(root: Path) -> None:
        volumes.remove_tree(root)  # the workspace volume and any grading job's volumes in it

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None:
            raise SessionNotFound(session_id)
        session.last_used = time.time()
        return session

    async def close(self, session_id: str, reason: str = "client") -> dict:
        session = self._sessions.pop(session_id, None)
        if session is None:
            raise SessionNotFound(session_id)
        session.closed = True
        try:
            await session.lease.close()  # kills a running verifier: a grade in flight ends quickly
            try:
                await asyncio.wait_for(session.not_grading.wait(), 30)  # it releases its own job
            except TimeoutError:
                pass
        finally:
            await asyncio.to_thread(self._remove_root, session.root)
        self.metrics.sessions_closed.labels(reason=reason).inc()
        return {"session_id": session_id, "closed": True, "reason": reason}

    async def reset(
        self,
        session_id: str,
        task_id: str | None,
        seed: int | None = None,
        ttl_s: float | None = None,
        episode_id: str | None = None,
    ) -> Session:
        """A fresh episode in session `session_id` (OpenEnv's reset): same id, a new workspace of
        `task_id`. The task is checked first, so a bad reset leaves the session as it was."""
        old = self.get(session_id)
        if old.grading:
            raise SessionBusy(f"session {session_id!r} is being graded; reset it when the grade has returned")
        task_id, seed = self.resolve_task(task_id, seed)
        await asyncio.to_thread(self.store.get, task_id, seed)
        attached, ttl = old.attached, old.ttl_s if ttl_s is None else ttl_s
        await self.close(session_id, reason="reset")
        session = await self.create(task_id, seed, ttl, session_id=session_id, episode_id=episode_id)
        session.attached = attached
        return session

    async def close_all(self, reason: str = "shutdown") -> None:
        await asyncio.gather(*(self.close(sid, reason) for sid in list(self._sessions)), return_exceptions=True)

    # ---------------------------------------------------------------- actions
    def offered_tools(self) -> tuple[str, ...]:
        """The tools every session of this server is offered (listings made without a session:
        GET /tools, tools/list); the web tools only with `--web-search-offer all`. A session's own
        list is in its create/reset response and in tools/list with its session_id."""
        every = self.web_tools is not None and self.web_tools.offer == "all"
        return protocol.session_tool_names(every)

    def web_for(self, task: Task) -> Backend | None:
        """The web backend a session of `task` gets, or None when it is not offered the web tools.
        Its task.toml's `[agent] web_search` is checked whatever the server's configuration."""
        try:
            wanted = task_wants_web(task.config.raw, task.task_id)
        except ValueError as exc:  # [agent] web_search is not a boolean
            raise TaskError(str(exc)) from None
        if self.web_tools is None or not (wanted or self.web_tools.offer == "all"):
            return None
        self.web_tools.backend.prepare()
        return self.web_tools.backend

    async def call_tools(self, session_id: str, calls: list[tuple[str, dict]]) -> list[dict]:
        session = self.get(session_id)
        for name, _ in calls:  # the transports check this first (an error they report); a backstop
            if name not in session.tool_names:
                protocol.validate_call(name, {}, session.tool_names)
        if session.grading:
            raise SessionBusy(
                f"session {session_id!r} is being graded; tool calls are refused until "
                "POST /sessions/{id}/grade returns"
            )
        session.busy += 1
        session.calls_in_flight += 1
        session.idle.clear()
        try:
            results = await tools.call_tools(session, calls)
        finally:
            session.busy -= 1
            session.calls_in_flight -= 1
            if session.calls_in_flight == 0:
                session.idle.set()
            session.last_used = time.time()
        session.tool_calls += len(calls)
        for (name, _), res in zip(calls, results):
            self.metrics.tool_call(name, bool(res["ok"]), res["duration_s"])
        return results

    async def grade(self, session_id: str) -> grader.GradeResult:
        session = self.get(session_id)
        if session.grading:
            raise SessionBusy(f"session {session_id!r} is already being graded; wait for that grade's result")
        session.grading = True
        session.not_grading.clear()
        session.busy += 1
        try:
            await session.idle.wait()  # the tool calls in flight finish first
            if session.closed:
                raise SessionNotFound(session_id)
            # Nothing of the session may run while its workspace is copied.
            await session.lease.kill_processes()
            result = await grader.grade(
                session.task,
                session.lease,
                session.workspace.root,
                session.root,
                self.limits,
                session.env,
                cache=self.grade_cache,
            )
        except RuntimeError:
            if session.closed:  # closed mid-grade: the lease refused to run, or the copy vanished
                raise SessionNotFound(session_id) from None
            raise
        finally:
            session.busy -= 1
            session.grading = False
            session.not_grading.set()
            session.last_used = time.time()
        if session.closed:
            raise SessionNotFound(session_id)
        session.grades += 1
        session.last_reward = result.reward
        self.metrics.grades.inc()
        if result.cached:
            self.metrics.grade_cache_hits.inc()
        self.metrics.grade_seconds.observe(result.duration_s)
        return result

    # ---------------------------------------------------------------- TTL
    async def reap_expired(self) -> list[str]:
        now = time.time()
        expired = [sid for sid, s in self._sessions.items() if not s.busy and now > s.last_used + s.ttl_s]
        for sid in expired:
            try:
                await self.close(sid, reason="ttl")
            except SessionNotFound:
                pass
        return expired

    async def sweep_orphans(self) -> int:
        """End the sandboxes a killed server left running (`Sandbox.sweep_orphans`); how many."""
        swept = await asyncio.to_thread(self.sandbox.sweep_orphans)  # a /proc scan: off the event loop
        if swept:
            log.warning("ended the processes of %d sandbox uid(s) that a killed server left running", swept)
        return swept

    def start_reaper(self, interval_s: float = 5.0) -> None:
        """Every `interval_s`: close expired sessions and end orphaned sandboxes (first at once)."""

        async def loop():
            await self.sweep_orphans()
            while True:
                await asyncio.sleep(interval_s)
                await self.reap_expired()
                await self.sweep_orphans()

        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(loop())

    async def shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        await self.close_all()
        await asyncio.to_thread(self.release_work_dir)

    def release_work_dir(self) -> None:
        """Unmount and delete everything under the work dir (all of it if this server made it)."""
        volumes.remove_tree(self.work_dir if self._own_work_dir else self.sessions_dir)
        if self._work_dir_lock is not None:
            os.close(self._work_dir_lock)
            self._work_dir_lock = None
