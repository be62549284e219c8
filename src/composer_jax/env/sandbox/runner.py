"""Sandboxes that run a session's shell commands and tests.

`Sandbox` is the backend interface (a container or microVM backend for clusters implements the
same two methods); `SandboxLease` is one session's identity inside it. Backends:

* `BubblewrapSandbox` (default): every command runs in a fresh bubblewrap sandbox with
  no network (new net namespace), its own PID/IPC/UTS namespaces, an empty tmpfs root with the
  system directories (`/usr`, `/etc`, the Python installation the server runs on; never the
  server's own virtualenv) and the verifier's toolchain (`toolchain.py`: pytest, pip, at
  /opt/verifier, first on PATH) bound read-only, the session's
  workspace bound read-write at `/app`, a size-limited tmpfs `/tmp`, and the command running as a
  per-session unprivileged uid with no capabilities and `no_new_privs`. Resource limits are
  rlimits (CPU time, address space, processes, file size, open files) plus, where the host lets
  us, a per-session cgroup (memory, pids). The wall clock is enforced here, and all of a
  session's processes are killed when the lease closes.
* `LocalProcessSandbox`: runs commands as plain host processes with rlimits only. It isolates
  nothing and exists for development on machines without bubblewrap; the server refuses to use it
  unless `--unsafe-no-sandbox` is given.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import fcntl
import functools
import os
import secrets
import shutil
import signal
import sys
import time
from pathlib import Path

from composer_jax.env.sandbox import toolchain
from composer_jax.env.sandbox.cgroups import CgroupLimiter

# Per-session uids come from this range so that RLIMIT_NPROC (counted per real uid) and
# kill-by-uid are per session. 200000+ is above the usual subordinate-uid ranges of real users.
UID_BASE = 200_000
UID_COUNT = 60_000
# In the environment of every bwrap a lease launches (never inside: bwrap --clearenv), the lease's
# uid: `_UidPool.sweep_orphans` finds a sandbox a killed server left half set up by it.
SANDBOX_UID_VAR = "COMPOSER_JAX_SANDBOX_UID"


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits for one command (wall_seconds, output_bytes) and one session (the rest)."""

    wall_seconds: float = 30.0
    cpu_seconds: int = 60
    memory_mb: int = 2048  # address space per process (RLIMIT_AS) and cgroup memory per session
    processes: int = 128  # RLIMIT_NPROC for the session uid, and cgroup pids.max
    file_size_mb: int = 256  # RLIMIT_FSIZE
    open_files: int = 512
    tmp_mb: int = 256  # the /tmp tmpfs
    output_bytes: int = 64 * 1024  # returned per stream; more is counted and dropped

    def with_(self, **changes) -> Limits:
        return dataclasses.replace(self, **changes)

    def prlimit(self, *, nproc: bool) -> list[str]:
        """The `prlimit ... --` argv prefix that puts these rlimits on one command. `nproc` adds
        RLIMIT_NPROC, which counts every process of the real uid: the bubblewrap backend's uid is
        the session's own, the unsafe local backend's is the host user's (left without it)."""
        return [
            "prlimit",
            f"--cpu={self.cpu_seconds}",
            f"--as={self.memory_mb * 2**20}",
            *([f"--nproc={self.processes}"] if nproc else []),
            f"--fsize={self.file_size_mb * 2**20}",
            f"--nofile={self.open_files}",
            "--core=0",
            "--",
        ]


def parent_guard() -> list[str]:
    """The argv prefix of every sandboxed command: SIGKILL when this process (the server) dies, and
    no start at all if it already has. `setpriv --pdeathsig` arms the death signal (kept across the
    exec of the non-set-uid programs that follow), then the shell checks its parent is still this
    process. Without it a server killed while a command was between its fork and bubblewrap's own
    `--die-with-parent` left that command running, its bwrap reparented to init (found by
    tests/runtime/test_supervisor.py under load)."""
    return [
        "setpriv",
        "--pdeathsig",
        "KILL",
        "--",
        "/bin/sh",
        "-c",
        f'[ "$PPID" = {os.getpid()} ] || exit 125; exec "$@"',
        "sh",
    ]


@dataclasses.dataclass(frozen=True)
class Mount:
    """A host directory visible inside the sandbox at `dest`."""

    host: Path
    dest: str
    writable: bool = False


@dataclasses.dataclass(frozen=True)
class SandboxCommand:
    """What a lease runs: `argv` inside the sandbox with `mounts`, from `cwd`, under `limits`, with
    `env` added to the sandbox's environment; `network` shares the host's network."""

    argv: list[str]
    mounts: list[Mount]
    cwd: str
    limits: Limits
    env: dict[str, str]
    network: bool = False


@dataclasses.dataclass
class ExecResult:
    exit_code: int | None  # None when killed by the wall-clock timeout
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool  # output beyond Limits.output_bytes was dropped
    duration_s: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Set in every sandbox. Tasks use the standard library and plain pytest; the host venv's other
# pytest plugins (hypothesis, schemathesis, ...) would add ~1.3 s of start-up to every test run.
SANDBOX_ENV = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}

# Where a Python installation outside /usr (pyenv's, a home directory's) is seen in a sandbox.
PYTHON_MOUNT = "/opt/python"

# Placeholder in a lease's argv for the descriptor that carries its hidden arguments.
ARGS_FD = "\0args-fd"

# Reading stops (and the command is killed) after this many times the returned cap: `yes` must
# not keep a server thread busy for the whole wall-clock budget.
_HARD_OUTPUT_FACTOR = 64


@dataclasses.dataclass
class SandboxStats:
    """A backend's sandboxed commands, counted by its leases (the server's /metrics reads them):
    `started` commands, `running` now, `failed[reason]` whose sandbox did not come up (spawn: the
    launcher could not be executed; setup: bubblewrap refused to build the sandbox), `killed[reason]`
    by a limit (timeout: the wall clock; output: output past `_HARD_OUTPUT_FACTOR` x the cap;
    orphaned: a killed server's session uid whose processes `Sandbox.sweep_orphans` ended)."""

    started: int = 0
    running: int = 0
    failed: dict[str, int] = dataclasses.field(default_factory=dict)
    killed: dict[str, int] = dataclasses.field(default_factory=dict)

    def count(self, table: dict[str, int], reason: str) -> None:
        table[reason] = table.get(reason, 0) + 1


class _OutputDrain:
    """A command's stdout and stderr read to end-of-file: the first `cap` bytes of each kept,
    the rest counted and dropped (`truncated`). Past `hard` bytes in all it sets `overflow` (the
    lease then kills the command) and keeps reading and discarding: asyncio's Process.wait() only
    returns once the pipes are drained and closed."""

    def __init__(self, cap: int, hard: int):
        self.cap, self.hard = cap, hard
        self.stdout, self.stderr = bytearray(), bytearray()
        self.seen = 0
        self.truncated = False
        self.overflow = asyncio.Event()

    def start(self, proc: asyncio.subprocess.Process) -> list[asyncio.Future]:
        """One reading task per pipe of `proc`."""
        assert proc.stdout is not None and proc.stderr is not None  # both are PIPEs
        return [
            asyncio.ensure_future(self._drain(proc.stdout, self.stdout)),
            asyncio.ensure_future(self._drain(proc.stderr, self.stderr)),
        ]

    async def _drain(self, stream: asyncio.StreamReader, kept: bytearray) -> None:
        while chunk := await stream.read(65536):
            self.seen += len(chunk)
            room = self.cap - len(kept)
            if room > 0:
                kept += chunk[:room]
            if len(chunk) > max(room, 0):
                self.truncated = True
            if self.seen > self.hard:
                self.overflow.set()


class SandboxLease(abc.ABC):
    """One session's identity in a sandbox backend; every command it runs is tracked."""

    def __init__(self, uid: int, gid: int, stats: SandboxStats | None = None):
        self.uid, self.gid = uid, gid
        self.stats = stats if stats is not None else SandboxStats()  # the backend's, shared by its leases
        self._procs: set[asyncio.subprocess.Process] = set()
        self.closed = False

    @abc.abstractmethod
    def _argv(self, cmd: SandboxCommand) -> tuple[list[str], str | None, list[str]]:
        """The host argv that runs `cmd` in the sandbox, the host cwd to start it in, and
        arguments handed over through a file descriptor (`ARGS_FD` in argv stands for its number)
        so that they do not show in the sandbox's /proc/1/cmdline."""

    def path_in_sandbox(self, mount: Mount) -> str:
        """Where a command run by this lease sees `mount`."""
        return mount.dest

    def launcher_env(self) -> dict[str, str] | None:
        """The environment the host argv starts with (None: this process's own)."""
        return None

    def setup_failed(self, result: ExecResult) -> bool:
        """Whether `result` is the backend's own refusal to build the sandbox (not the command's)."""
        return False

    async def kill_processes(self) -> None:
        """Kill every process of this session now (the lease stays usable)."""
        await self._kill_tracked()

    async def _kill_tracked(self) -> None:
        """Kill the processes this lease started and wait (5 s each at most) for them to end."""
        for proc in list(self._procs):
            self._kill(proc)
        for proc in list(self._procs):
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except TimeoutError:
                pass

    async def run(
        self,
        command: list[str],
        *,
        mounts: list[Mount],
        cwd: str = "/app",
        limits: Limits,
        env: dict[str, str] | None = None,
        network: bool = False,
    ) -> ExecResult:
        """Run `command` inside the sandbox, bounded by `limits`; never raises on command failure.

        `network` shares the host's network (only for building a task's Python environment from a
        package index, `pyenv.py`; sessions, verifiers and solutions never get it)."""
        if self.closed:
            raise RuntimeError("sandbox lease is closed")
        argv, host_cwd, hidden = self._argv(SandboxCommand(command, mounts, cwd, limits, env or {}, network))
        start = time.monotonic()
        proc = await self._spawn(argv, host_cwd, hidden)
        output = _OutputDrain(limits.output_bytes, limits.output_bytes * _HARD_OUTPUT_FACTOR)
        timed_out = await self._wait(proc, output, limits.wall_seconds)
        result = ExecResult(
            exit_code=None if timed_out else proc.returncode,
            stdout=output.stdout.decode("utf-8", "replace"),
            stderr=output.stderr.decode("utf-8", "replace"),
            timed_out=timed_out,
            truncated=output.truncated or output.overflow.is_set(),
            duration_s=round(time.monotonic() - start, 4),
        )
        self._count_end(result, output.overflow.is_set())
        return result

    async def _spawn(self, argv: list[str], host_cwd: str | None, hidden: list[str]) -> asyncio.subprocess.Process:
        """Start `argv` as a new process group with piped output, tracked by this lease; `hidden`
        arguments go through a memfd whose number replaces `ARGS_FD` in argv."""
        args_fd = None
        if hidden:
            args_fd = os.memfd_create("sandbox-args")
            os.write(args_fd, b"".join(os.fsencode(a) + b"\0" for a in hidden))
            os.lseek(args_fd, 0, os.SEEK_SET)
            argv = [str(args_fd) if a == ARGS_FD else a for a in argv]
        self.stats.started += 1
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=host_cwd,
                start_new_session=True,
                pass_fds=() if args_fd is None else (args_fd,),
                env=self.launcher_env(),
            )
        except OSError:
            self.stats.count(self.stats.failed, "spawn")
            raise
        finally:
            if args_fd is not None:
                os.close(args_fd)
        self._procs.add(proc)
        return proc

    async def _wait(self, proc: asyncio.subprocess.Process, output: _OutputDrain, wall_seconds: float) -> bool:
        """Drain `proc`'s output until it exits, killing it at the wall clock or on output
        overflow; whether the wall clock killed it. The process is gone and untracked after."""
        readers = output.start(proc)
        waiter = asyncio.ensure_future(proc.wait())
        overflow_wait = asyncio.ensure_future(output.overflow.wait())
        timed_out = False
        self.stats.running += 1
        try:
            done, _ = await asyncio.wait(
                {waiter, overflow_wait}, timeout=wall_seconds, return_when=asyncio.FIRST_COMPLETED
            )
            if waiter not in done:
                timed_out = not output.overflow.is_set()
                self._kill(proc)
            # A background child that escaped the process group could keep the pipes open (only
            # possible without a PID namespace): do not wait for end-of-file for long.
            _, pending = await asyncio.wait(readers + [waiter], timeout=5.0)
            for task in pending:
                task.cancel()
        finally:
            overflow_wait.cancel()
            if proc.returncode is None:
                self._kill(proc)
            self._procs.discard(proc)
            self.stats.running -= 1
        return timed_out

    def _count_end(self, result: ExecResult, overflow: bool) -> None:
        """A finished command in `stats`: killed by a limit, or refused by the backend's setup."""
        stats = self.stats
        if result.timed_out or overflow:
            stats.count(stats.killed, "timeout" if result.timed_out else "output")
        elif self.setup_failed(result):
            stats.count(stats.failed, "setup")

    @staticmethod
    def _kill(proc: asyncio.subprocess.Process) -> None:
        # The command is a process-group leader (start_new_session); bubblewrap's PID namespace
        # takes everything inside down with it when its init dies.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    async def close(self) -> None:
        """Kill every process this lease started (and anything they left behind)."""
        self.closed = True
        await self._kill_tracked()
        self._procs.clear()


class Sandbox(abc.ABC):
    """A sandbox backend: hands out per-session leases, which count their commands in `stats`."""

    name: str = "abstract"
    isolated: bool = False

    @functools.cached_property
    def stats(self) -> SandboxStats:
        """The commands of every lease of this backend (made at first use: a subclass need not call
        an `__init__` of this class)."""
        return SandboxStats()

    @abc.abstractmethod
    def lease(self, session_id: str) -> SandboxLease:
        """A new identity for one session (released with `await lease.close()`)."""

    def describe(self) -> dict:
        return {"backend": self.name, "isolated": self.isolated}

    def sweep_orphans(self) -> int:
        """End sandboxed processes that a killed server left behind; how many uids were swept
        (counted in `stats.killed["orphaned"]`). A backend that cannot tell them apart sweeps none."""
        return 0


class _UidPool:
    """Session uids, unique across every server process on the host.

    Two servers on one machine must never hand out the same uid: RLIMIT_NPROC would be shared and
    closing a session kills every process of its uid. Each uid in use is held by an flock on a file
    in LOCK_DIR, which the kernel releases if the server dies.
    """

    LOCK_DIR = Path("/tmp/composer-jax-env-uids")

    def __init__(self) -> None:
        self._next = secrets.randbelow(UID_COUNT)
        self._held: dict[int, int] = {}  # uid -> lock file descriptor
        self.LOCK_DIR.mkdir(mode=0o700, exist_ok=True)

    def take(self) -> int:
        for _ in range(UID_COUNT):
            uid = UID_BASE + self._next
            self._next = (self._next + 1) % UID_COUNT
            if uid in self._held:
                continue
            fd = os.open(self.LOCK_DIR / str(uid), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._held[uid] = fd
            return uid
        raise RuntimeError("no free sandbox uid")

    def give(self, uid: int) -> None:
        fd = self._held.pop(uid, None)
        if fd is not None:
            os.close(fd)  # closing releases the flock

    def sweep_orphans(self) -> list[int]:
        """SIGKILL what runs for every pool uid that no live server holds; the uids swept.

        A server killed while a sandbox was being set up can leave it behind: bubblewrap's PID 1
        arms its own death signal only once its setup is done (bubblewrap 0.8, `do_init`), so when
        the server and then the outer bwrap die before that, the sandbox's PID 1 outlives both,
        reparented to init: it either starts the command anyway (which runs as the session's uid)
        or waits forever on the outer bwrap's signal (as root, a `bwrap` marked with the uid in its
        environment, `SANDBOX_UID_VAR`). A uid whose lock nobody holds belongs to no session; its
        lock is held here while its processes are killed, so no server can hand it out meanwhile."""
        found = _sandbox_processes()
        swept = []
        for uid in sorted(set(found) - set(self._held)):
            fd = os.open(self.LOCK_DIR / str(uid), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live server's session
            else:
                for pid in found[uid]:
                    with contextlib.suppress(OSError):  # gone meanwhile
                        os.kill(pid, signal.SIGKILL)
                _kill_uid(uid)  # and what the command started since the scan
                swept.append(uid)
            finally:
                os.close(fd)
        return swept


def _processes() -> list[tuple[int, int]]:
    """(pid, real uid) of every process this host's /proc lists."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        found.append((int(entry), int(line.split()[1])))
                        break
        except (OSError, ValueError):
            continue
    return found


def _sandbox_processes() -> dict[int, list[int]]:
    """Pool uid -> the pids running for it: its processes, and the bwraps launched for it."""
    found: dict[int, list[int]] = {}
    marker = f"{SANDBOX_UID_VAR}=".encode()
    for pid, uid in _processes():
        if not UID_BASE <= uid < UID_BASE + UID_COUNT:
            try:
                with open(f"/proc/{pid}/comm", "rb") as f:
                    if f.read().strip() != b"bwrap":
                        continue
                with open(f"/proc/{pid}/environ", "rb") as f:
                    marked = [v for v in f.read().split(b"\0") if v.startswith(marker)]
                uid = int(marked[0][len(marker) :]) if marked else -1
            except (OSError, ValueError):
                continue
            if not UID_BASE <= uid < UID_BASE + UID_COUNT:
                continue
        found.setdefault(uid, []).append(pid)
    return found


def _kill_uid(uid: int) -> None:
    """SIGKILL every process whose real uid is `uid` (a session's uid is used by nothing else)."""
    for pid, owner in _processes():
        if owner == uid:
            with contextlib.suppress(OSError):  # gone meanwhile
                os.kill(pid, signal.SIGKILL)


class BubblewrapLease(SandboxLease):
    def __init__(self, sandbox: BubblewrapSandbox, session_id: str, uid: int):
        super().__init__(uid, uid, sandbox.stats)
        self.sandbox = sandbox
        self.cgroup = sandbox.cgroups.create(session_id, sandbox.session_limits) if sandbox.cgroups else None

    def _argv(self, cmd: SandboxCommand) -> tuple[list[str], str | None, list[str]]:
        # bwrap's options (host paths of the workspace, the environment) go through `--args FD`:
        # as argv they would be readable inside the sandbox in /proc/1/cmdline (bwrap is PID 1).
        sb = self.sandbox
        argv: list[str] = parent_guard()
        if self.cgroup is not None:
            argv += self.cgroup.enter_prefix()
        argv += cmd.limits.prlimit(nproc=True)
        argv += [sb.bwrap, "--args", ARGS_FD]
        opts = sb.base_args()[1:]  # without the bwrap binary itself
        if cmd.network:
            opts.remove("--unshare-net")
        # /tmp first, then what must be visible under it (a virtualenv living in /tmp), then mounts.
        opts += ["--perms", "1777", "--size", str(cmd.limits.tmp_mb * 2**20), "--tmpfs", "/tmp"]
        for p in sb.tmp_ro_paths:
            opts += sb.parent_dirs(p, skip=("/tmp",)) + ["--ro-bind", p, p]
        for m in cmd.mounts:
            opts += sb.parent_dirs(m.dest)
            opts += ["--bind" if m.writable else "--ro-bind", str(m.host), m.dest]
        # Nothing of the server's environment (tokens, credentials) is passed on: only full_env.
        opts += ["--chdir", cmd.cwd, "--clearenv"]
        full_env = {
            "PATH": sb.path_env,
            "HOME": "/tmp",
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "PYTHONDONTWRITEBYTECODE": "1",
            "USER": "agent",
            # Every command has a PID namespace of its own: a verifier may end every other process
            # in it before it writes a reward (tasks/verifier.py `end_strays`).
            "SANDBOX_PID_NAMESPACE": "1",
            **SANDBOX_ENV,
            **sb.python_env,
            **cmd.env,
        }
        for key, value in full_env.items():
            opts += ["--setenv", key, value]
        if sb.privileged:
            # bwrap keeps root's capabilities for its own setup; setpriv then drops to the
            # session uid with an empty bounding set, so nothing inside can regain privilege.
            argv += [
                "--",
                "setpriv",
                f"--reuid={self.uid}",
                f"--regid={self.gid}",
                "--clear-groups",
                "--inh-caps=-all",
                "--bounding-set=-all",
                "--no-new-privs",
            ]
        else:
            opts += ["--unshare-user", "--disable-userns", "--uid", "1000", "--gid", "1000"]
            argv += ["--"]
        return argv + cmd.argv, None, opts

    def launcher_env(self) -> dict[str, str]:
        return {**os.environ, SANDBOX_UID_VAR: str(self.uid)}

    def setup_failed(self, result: ExecResult) -> bool:
        # bwrap reports its own errors as "bwrap: ..." on stderr and exits 1 (its die()).
        return result.exit_code == 1 and result.stderr.startswith("bwrap: ")

    async def kill_processes(self) -> None:
        await super().kill_processes()
        # Every process of the session is in its cgroup (nothing inside can leave it: no /sys);
        # without one, scan /proc for the session's uid.
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.kill)
        elif self.sandbox.privileged:
            await asyncio.to_thread(_kill_uid, self.uid)

    async def close(self) -> None:
        await super().close()
        # /proc scans and cgroup teardown block: keep them off the event loop.
        if self.sandbox.privileged:
            await asyncio.to_thread(_kill_uid, self.uid)
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.kill_and_remove)
        self.sandbox.uids.give(self.uid)


class BubblewrapSandbox(Sandbox):
    """The default backend: one bubblewrap sandbox per command (see the module docstring)."""

    name = "bubblewrap"
    isolated = True

    def __init__(
        self,
        session_limits: Limits | None = None,
        bwrap: str | None = None,
        use_cgroups: bool = True,
        toolchain_root: Path | None = None,
    ):
        found = bwrap or shutil.which("bwrap")
        if not found:
            raise RuntimeError(
                "bubblewrap (bwrap) is not installed; install it (apt-get install "
                "bubblewrap, or `make system-deps`) or pass --unsafe-no-sandbox"
            )
        self.bwrap: str = found
        self.privileged = os.geteuid() == 0
        self.session_limits = session_limits or Limits()
        self.cgroups = CgroupLimiter.detect() if (use_cgroups and self.privileged) else None
        self.uids = _UidPool()
        # The Python installation the server's virtualenv was made from: a system one under /usr is
        # seen where it is; another (pyenv's under a home directory) at PYTHON_MOUNT, so no session
        # lists a host directory (its binary finds libpython through LD_LIBRARY_PATH there).
        base = os.path.realpath(sys.base_prefix)
        system = base == "/usr" or base.startswith("/usr/")
        self.python_prefix = base if system else PYTHON_MOUNT
        self.python_env = {} if system else {"LD_LIBRARY_PATH": f"{PYTHON_MOUNT}/lib"}
        self._python_bind = [] if system else self.parent_dirs(PYTHON_MOUNT) + ["--ro-bind", base, PYTHON_MOUNT]
        self.toolchain = toolchain.toolchain(toolchain_root, python_prefix=self.python_prefix)
        paths = self._system_paths()
        # A private tmpfs is mounted on /tmp after the base binds: what lives under the host's
        # /tmp (a virtualenv there) is bound again on top of it (`tmp_ro_paths`).
        self.tmp_ro_paths = [p for p in paths if p == "/tmp" or p.startswith("/tmp/")]
        self._ro_paths = [p for p in paths if p not in self.tmp_ro_paths]
        self.path_env = ":".join(
            [f"{toolchain.TOOLCHAIN_MOUNT}/bin", f"{self.python_prefix}/bin"]
            + ["/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin"]
        )
        self._base = self._build_base_args()

    @staticmethod
    def _system_paths() -> list[str]:
        # not the server's virtualenv, whose packages the toolchain replaces; the Python
        # installation is /usr's or bound at PYTHON_MOUNT (__init__)
        return ["/usr", "/etc"]

    def python_executable(self) -> str:
        """The server's Python as sandboxes see it (its major.minor), for task environment builds."""
        return f"{self.python_prefix}/bin/python{sys.version_info.major}.{sys.version_info.minor}"

    @staticmethod
    def parent_dirs(dest: str, skip: tuple[str, ...] = ()) -> list[str]:
        """bwrap creates missing parents with mode 0700 when run as root; make them traversable."""
        args, parts = [], Path(dest).parts[1:-1]
        for i in range(len(parts)):
            d = "/" + "/".join(parts[: i + 1])
            if d not in skip:
                args += ["--perms", "0755", "--dir", d]
        return args

    def _build_base_args(self) -> list[str]:
        args = [
            self.bwrap,
            "--unshare-pid",
            "--unshare-net",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--die-with-parent",
            "--new-session",
            "--hostname",
            "sandbox",
            "--tmpfs",
            "/",
        ]
        for p in self._ro_paths:
            args += self.parent_dirs(p) + ["--ro-bind", p, p]
        mount = toolchain.TOOLCHAIN_MOUNT
        args += self._python_bind + self.parent_dirs(mount) + ["--ro-bind", str(self.toolchain), mount]
        for name in ("bin", "lib", "lib64", "sbin", "lib32"):
            if os.path.islink(f"/{name}"):
                args += ["--symlink", os.readlink(f"/{name}"), f"/{name}"]
            elif os.path.isdir(f"/{name}"):
                args += ["--ro-bind", f"/{name}", f"/{name}"]
        return args + ["--dev", "/dev", "--proc", "/proc"]

    def base_args(self) -> list[str]:
        return list(self._base)

    def sweep_orphans(self) -> int:
        # Unprivileged, a session's processes run as this host user (found by their bwrap alone).
        swept = self.uids.sweep_orphans()
        for _ in swept:
            self.stats.count(self.stats.killed, "orphaned")
        return len(swept)

    def lease(self, session_id: str) -> SandboxLease:
        return BubblewrapLease(self, session_id, self.uids.take())

    def describe(self) -> dict:
        return {
            "backend": self.name,
            "isolated": True,
            "privileged_setup": self.privileged,
            "cgroups": self.cgroups.kind if self.cgroups else None,
        }


class LocalLease(SandboxLease):
    """UNSAFE: host processes with rlimits only. Paths such as /app do not exist here; the
    workspace is the cwd and mounts are exported as environment variables (APP_DIR, TESTS_DIR...)."""

    def path_in_sandbox(self, mount: Mount) -> str:
        return str(mount.host)  # no mount namespace: commands see host paths

    def _argv(self, cmd: SandboxCommand) -> tuple[list[str], str | None, list[str]]:
        host_cwd = None
        exports = {}
        for m in cmd.mounts:
            name = m.dest.strip("/").replace("/", "_").upper() + "_DIR"
            exports[name] = str(m.host)
            if cmd.cwd == m.dest or cmd.cwd.startswith(m.dest + "/"):
                host_cwd = str(m.host) + cmd.cwd[len(m.dest) :]
        exported = [f"{k}={v}" for k, v in {**SANDBOX_ENV, **exports, **cmd.env}.items()]
        return parent_guard() + cmd.limits.prlimit(nproc=False) + ["env", *exported] + cmd.argv, host_cwd, []


class LocalProcessSandbox(Sandbox):
    """UNSAFE development backend (`--unsafe-no-sandbox`): no isolation at all."""

    name = "local-process-UNSAFE"
    isolated = False

    def lease(self, session_id: str) -> SandboxLease:
        return LocalLease(os.geteuid(), os.getegid(), self.stats)


def default_sandbox(unsafe_no_sandbox: bool = False, limits: Limits | None = None) -> Sandbox:
    """Bubblewrap when installed; the unsafe backend only when explicitly asked for."""
    if shutil.which("bwrap"):
        return BubblewrapSandbox(limits)
    if unsafe_no_sandbox:
        return LocalProcessSandbox()
    raise RuntimeError(
        "bubblewrap (bwrap) is not installed, so sessions cannot be sandboxed. Install it "
        "(`apt-get install bubblewrap` or `make system-deps`), or pass --unsafe-no-sandbox to run "
        "commands as plain host processes (no isolation; development only)"
    )
