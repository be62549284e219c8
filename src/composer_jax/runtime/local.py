"""The `local` placement (runtime/placement.py): a run's services as supervised child processes.

`Launcher` starts `composer-jax` subcommands as child processes bound to one host (127.0.0.1 for a
run's own services; a node's address when the `ray` placement runs one on a node) and keeps them up:

* **Bootstrap.** Every child starts as `python -c BOOTSTRAP CORES LAUNCHER_PID ARGS...`, whose first
  lines, before anything is imported, ask the kernel for SIGTERM when the launcher goes
  (`PR_SET_PDEATHSIG`), check that the launcher is still the parent (it may have died before that
  call), pin the process to CORES (children and threads inherit the mask, so an environment
  server's sandboxes follow it), then run `composer_jax.cli.main(ARGS)`. No `preexec_fn` (a fork of a
  multithreaded JAX process is unsafe there).
* **Readiness.** A child is ready when it has printed the ready line on its stdout,
  `{"event": "ready", "url": "http://HOST:PORT", "pid": N}` (`composer-jax env-server` and
  `composer-jax serve` print it once uvicorn serves; `parse_ready_line` reads it), and then answers
  `GET URL/health` with 200. Its stdout and stderr go to its log file, from which the line is read.
* **Timeout.** One bound per child start (`start_timeout_s`); an error names the child, the reason
  (its exit status, or the bound it missed) and the tail of its log.
* **Supervision.** One thread, alive as long as the launcher, starts every child (the kernel sends
  the death signal when the *thread* that forked a child ends, so no child is started from a
  caller's thread that may end first), reaps a child that exits, logs it, and restarts it on the
  same port (so clients holding the URL keep working; a fresh port only when that one cannot be
  bound again) after an exponential backoff. A child restarted `RestartPolicy.max_restarts` times
  within `window_s` is given up on, with a log line naming the reason. A child that fails its
  *first* start is not restarted: the start raises (a configuration error shows at once).
* **Hangs.** A running child is asked `GET URL/health` every `RestartPolicy.health_interval_s`
  seconds; one that fails `health_failures` probes in a row (hung: SIGSTOPped, deadlocked, a
  wedged event loop - alive, but of no use) is SIGKILLed and restarted as if it had died, the
  reason saying so (`{kind}/unresponsive` counts these).
* **Teardown.** `stop()` (also on an exception in the `with` block, or while starting) terminates
  every child, waits `grace_s`, kills what is left and waits again; a child outlives a launcher that
  dies without `stop()` (SIGKILL included) by no more than its own SIGTERM handling.

The learner's API is `runtime.placement.Placement`: `alive_urls()`, `wait_alive(count, timeout_s)`,
`restart_counts()`, `statuses()` (each child's state, URL, starts and last failure: what the rollout
side follows to put a restarted replica back in rotation, at its new URL if it moved), `metrics()`,
`replace()`. `rl/rollout/env_servers.py` (`LocalEnvServers`) and `rl/samplers/serve_launch.py`
(`LocalSamplers`) are two of its configurations.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Sequence
from urllib.parse import urlsplit

import httpx

from composer_jax.runtime.placement import (
    ALIVE,
    BACKOFF,
    FAILED,
    GIVEN_UP,
    LOOPBACK,
    START_TIMEOUT_S,
    STARTING,
    STOPPED,
    LaunchError,
    RestartPolicy,
    ServiceSpec,
    ServiceStatus,
    parse_ready_line,
)

log = logging.getLogger(__name__)

_TAIL_CHARS = 3000


# The child's first lines: die with the launcher, check it is still the parent, pin, then run the
# command. argv: CORES ("-" or "0,2,3"), the launcher's pid, then composer-jax's arguments.
BOOTSTRAP = """
import ctypes, os, signal, sys
cores, launcher, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != launcher:
    sys.exit("composer-jax launcher bootstrap: the launching process is gone")
if cores != "-":
    os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
from composer_jax.cli import main
sys.exit(main(argv))
"""


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """Terminate the running children (SIGTERM), SIGKILL those still alive after `grace_s`, wait
    for each (no zombies), and empty the list."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    procs.clear()


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def check_cores(cores: Collection[int], error: type[Exception] = LaunchError, what: str = "cores") -> frozenset[int]:
    """`cores` as a set, if every one is in this process's affinity set (else `error`, naming them)."""
    allowed = os.sched_getaffinity(0)
    given = list(cores)
    if not given or not all(isinstance(c, int) and not isinstance(c, bool) for c in given) or not set(given) <= allowed:
        raise error(f"{what}={given!r}: give CPU cores out of this process's {sorted(allowed)}")
    return frozenset(given)


class _Child:
    def __init__(self, spec: ServiceSpec):
        self.spec = spec
        self.proc: subprocess.Popen | None = None
        self.state = STOPPED
        self.port = 0  # the port to bind at the next start (0 until the first start is ready)
        self.url: str | None = None
        self.seen_url: str | None = None  # from this start's ready line
        self.log_start = 0  # where this start's output begins in the log
        self.scan_pos = 0  # how far the log has been read for the ready line
        self.deadline = 0.0
        self.next_start = 0.0
        self.ever_ready = False
        self.restarts = 0
        self.ready_count = 0  # starts that came up (the first one included)
        self.replacing = False  # a planned restart (`Launcher.replace`): neither counted nor backed off
        self.planned = False  # this start is a planned restart's
        self.recent: collections.deque[float] = collections.deque()  # restart times within the window
        self.reason: str | None = None  # why it was given up on
        self.last_failure: str | None = None  # why it last went down
        self.next_probe = 0.0  # when a running child is next asked for /health
        self.failed_probes = 0  # failed health probes in a row
        self.unresponsive = 0  # restarts because it stopped answering /health

    def tail(self) -> str:
        try:
            with open(self.spec.log_path, "rb") as f:
                f.seek(max(self.log_start, f.seek(0, os.SEEK_END) - _TAIL_CHARS))
                return f.read().decode(errors="replace")[-_TAIL_CHARS:]
        except OSError:
            return ""

    def scan_ready(self) -> None:
        """Read this start's new complete log lines; keep the first ready line's URL."""
        try:
            with open(self.spec.log_path, "rb") as f:
                f.seek(self.scan_pos)
                chunk = f.read()
        except OSError:
            return
        end = chunk.rfind(b"\n") + 1
        self.scan_pos += end
        for raw in chunk[:end].splitlines():
            ready = parse_ready_line(raw.decode(errors="replace"))
            if ready is not None and self.seen_url is None:
                self.seen_url = ready[0]


class Launcher:
    """Children from `specs`, started and supervised by one thread; `with Launcher(...) as urls:`.

    `urls[i]` is child i's URL; the list object stays the same for the launcher's life (a child
    that had to move to another port is updated in place). `host`: the address every child binds
    (`ServiceSpec.argv(host, port)`)."""

    def __init__(
        self,
        specs: Sequence[ServiceSpec],
        *,
        kind: str = "children",
        host: str = LOOPBACK,
        start_timeout_s: float = START_TIMEOUT_S,
        restart: RestartPolicy | None = None,
        error: type[Exception] = LaunchError,
        grace_s: float = 10.0,
        poll_s: float = 0.1,
    ):
        if not specs:
            raise error("no children to launch: give at least one ServiceSpec")
        for name, value in (("start_timeout_s", start_timeout_s), ("grace_s", grace_s), ("poll_s", poll_s)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise error(f"{name}={value!r}; accepted: seconds > 0")
        self.kind, self.start_timeout_s, self.error = kind, float(start_timeout_s), error
        self.host = host
        self.restart = RestartPolicy() if restart is None else restart
        self.grace_s, self.poll_s = grace_s, poll_s
        self._children = [_Child(s) for s in specs]
        self.urls: list[str] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._started = threading.Event()
        self._start_error: str | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the learner's API
    @property
    def procs(self) -> list[subprocess.Popen]:
        """The children's current processes (empty once stopped)."""
        with self._lock:
            return [c.proc for c in self._children if c.proc is not None]

    def alive_urls(self) -> list[str]:
        """The URLs of the children that are up now (ready, process running)."""
        with self._lock:
            return [
                c.url
                for c in self._children
                if c.state == ALIVE and c.url and c.proc is not None and c.proc.poll() is None
            ]

    def wait_alive(self, count: int = 1, timeout_s: float = 60.0) -> list[str]:
        """Wait (at most `timeout_s`) until at least `count` children are up; their URLs. Raises the
        launcher's error naming each child's state (and why one was given up on) on timeout."""
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= len(self._children):
            raise self.error(f"count={count!r}; accepted: an int from 1 to {len(self._children)}")
        deadline = time.monotonic() + timeout_s
        while True:
            alive = self.alive_urls()
            if len(alive) >= count or time.monotonic() >= deadline:
                break
            time.sleep(min(0.05, self.poll_s))
        if len(alive) >= count:
            return alive
        with self._lock:
            states = "; ".join(f"{c.spec.name}: {c.reason or c.state}" for c in self._children)
        raise self.error(
            f"{len(alive)} of {len(self._children)} {self.kind} alive after {timeout_s:g} s, {count} wanted ({states})"
        )

    def restart_counts(self) -> list[int]:
        """How many times each child was restarted."""
        with self._lock:
            return [c.restarts for c in self._children]

    def statuses(self) -> list[ServiceStatus]:
        """Each child's state, URL, starts and last failure (`ServiceStatus`), in spec order."""
        with self._lock:
            return [
                ServiceStatus(c.spec.name, c.state, c.url, c.ready_count, c.restarts, c.last_failure)
                for c in self._children
            ]

    def given_up(self) -> dict[str, str]:
        """The children given up on: name -> reason."""
        with self._lock:
            return {c.spec.name: c.reason for c in self._children if c.state == GIVEN_UP and c.reason}

    def metrics(self) -> dict[str, float]:
        """`{kind}/alive`, `{kind}/restarts` (total), `{kind}/given_up`, `{kind}/unresponsive` (restarts
        of children that stopped answering /health) and `{kind}/restarts_<i>`."""
        counts = self.restart_counts()
        with self._lock:
            unresponsive = sum(c.unresponsive for c in self._children)
        out = {
            f"{self.kind}/alive": float(len(self.alive_urls())),
            f"{self.kind}/restarts": float(sum(counts)),
            f"{self.kind}/given_up": float(len(self.given_up())),
            f"{self.kind}/unresponsive": float(unresponsive),
        }
        out.update({f"{self.kind}/restarts_{i}": float(n) for i, n in enumerate(counts)})
        return out

    def replace(self, index: int, timeout_s: float, why: str = "asked for") -> str:
        """Stop child `index` and start it again on its port (its `argv(port)` is called anew, so a
        spec whose argv reads the launcher's state starts on what changed); waits (at most
        `timeout_s`) until it is up and returns its URL. A planned restart: not counted in
        `restart_counts` nor against the restart policy. Raises the launcher's error when it does not
        come back (it is then supervised as any child that went down)."""
        if not 0 <= index < len(self._children) or self._thread is None:
            raise self.error(
                f"replace({index!r}): give a child index from 0 to {len(self._children) - 1} of a started launcher"
            )
        c = self._children[index]
        with self._lock:
            if c.state == GIVEN_UP:
                raise self.error(f"{c.spec.name} was given up on: {c.reason}")
            before, proc = c.ready_count, c.proc
            c.proc, c.state, c.next_start, c.replacing = None, BACKOFF, float("inf"), True
        log.info("%s: stopping %s to start it again (%s)", self.kind, c.spec.name, why)
        if proc is not None:
            stop_processes([proc], self.grace_s)
        with self._lock:
            c.next_start = time.monotonic()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            with self._lock:
                if c.ready_count > before and c.state == ALIVE and c.url:
                    return c.url
                if c.state in (GIVEN_UP, STOPPED):
                    break
            time.sleep(min(0.05, self.poll_s))
        with self._lock:
            state = c.reason or c.state
        raise self.error(
            f"{c.spec.name} did not come back within {timeout_s:g} s ({why}): {state}; its log: {c.spec.log_path}"
        )

    # ------------------------------------------------------------------ start and stop
    def start(self) -> list[str]:
        """Start every child (together) and wait until each is ready; raises the launcher's error (and
        stops everything) when one is not. Returns `urls`."""
        if self._thread is not None:
            raise self.error(f"these {self.kind} were started already (a Launcher starts once)")
        self._thread = threading.Thread(
            target=self._supervise, name=f"composer-jax {self.kind} supervisor", daemon=True
        )
        self._thread.start()
        try:
            self._started.wait()
        except BaseException:
            self.stop()
            raise
        if self._start_error is not None:
            self.stop()
            raise self.error(self._start_error)
        return self.urls

    def stop(self) -> None:
        """Terminate every child (SIGTERM, then SIGKILL after `grace_s`) and wait for each; no restarts after."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._terminate_all()  # the supervisor did it already unless it never ran

    def __enter__(self) -> list[str]:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ the supervisor thread
    def _supervise(self) -> None:
        try:
            with self._lock:
                for c in self._children:
                    self._spawn(c)
            while not self._stop.is_set():
                for c in self._children:
                    if self._stop.is_set():
                        break
                    try:
                        with self._lock:
                            probe = self._step(c)
                        if probe is not None:  # outside the lock: the learner's calls do not wait for it
                            bound = 1.0 if c.state == STARTING else self.restart.probe_timeout_s
                            healthy = self._healthy(probe, bound)
                            with self._lock:
                                if healthy and c.state == STARTING and c.seen_url == probe:
                                    self._ready(c, probe)
                                elif c.state == ALIVE and c.url == probe:
                                    self._probed(c, healthy)
                    except Exception:  # the supervisor must outlive any one child's trouble
                        log.exception("%s: supervising %s failed", self.kind, c.spec.name)
                with self._lock:
                    if not self._started.is_set():
                        if self._start_error is not None:
                            self._started.set()
                            break
                        if all(c.state == ALIVE for c in self._children):
                            self.urls.extend(c.url or "" for c in self._children)
                            self._started.set()
                self._stop.wait(self.poll_s)
        except BaseException as exc:
            log.exception("%s: the supervisor failed", self.kind)
            if self._start_error is None:
                self._start_error = f"the {self.kind} supervisor failed: {exc!r}"
        finally:
            self._terminate_all()
            self._started.set()

    def _spawn(self, c: _Child) -> None:
        spec = c.spec
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        cores = "-" if spec.cores is None else ",".join(str(x) for x in sorted(spec.cores))
        cmd = [sys.executable, "-c", BOOTSTRAP, cores, str(os.getpid()), *spec.argv(self.host, c.port)]
        with open(spec.log_path, "ab" if c.ever_ready else "wb") as out:
            if c.ever_ready:
                out.write(f"--- composer-jax launcher: restart {c.restarts} on port {c.port} ---\n".encode())
                out.flush()
            c.log_start = c.scan_pos = out.tell()
            c.seen_url, c.deadline = None, time.monotonic() + self.start_timeout_s
            try:
                c.proc = subprocess.Popen(
                    cmd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"},
                )
            except OSError as exc:
                c.proc = None
                self._failed(c, f"could not be started: {exc}")
                return
        c.state = STARTING

    def _step(self, c: _Child) -> str | None:
        """Advance `c` by what happened since the last look; the URL to probe for /health, if any."""
        now = time.monotonic()
        if c.state == STARTING:
            assert c.proc is not None
            if (rc := c.proc.poll()) is not None:
                self._failed(c, describe_exit(rc))
                return None
            if c.seen_url is None:
                c.scan_ready()
            if now >= c.deadline:
                c.proc.kill()
                c.proc.wait()
                missed = "print its ready line" if c.seen_url is None else f"answer {c.seen_url}/health"
                self._failed(c, f"did not {missed} within start_timeout_s={self.start_timeout_s:g} s")
                return None
            return c.seen_url
        elif c.state == ALIVE:
            assert c.proc is not None
            if (rc := c.proc.poll()) is not None:
                self._restart_later(c, f"(pid {c.proc.pid}, {c.url}) {describe_exit(rc)}")
            elif self.restart.health_interval_s > 0 and now >= c.next_probe:
                c.next_probe = now + self.restart.health_interval_s
                return c.url
        elif c.state == BACKOFF and now >= c.next_start:
            if c.replacing:
                c.replacing, c.planned = False, True
                log.info("%s: starting %s again on port %d (asked for)", self.kind, c.spec.name, c.port)
            else:
                c.restarts += 1
                c.recent.append(now)
                log.info("%s: restarting %s on port %d (restart %d)", self.kind, c.spec.name, c.port, c.restarts)
            self._spawn(c)
        return None

    @staticmethod
    def _healthy(url: str, timeout_s: float = 1.0) -> bool:
        try:
            return httpx.get(url + "/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def _probed(self, c: _Child, healthy: bool) -> None:
        """A running child's health probe came back; at `health_failures` failures in a row it is
        hung: killed (SIGKILL reaches a stopped process too) and restarted as a dead one."""
        if healthy:
            c.failed_probes = 0
            return
        c.failed_probes += 1
        policy = self.restart
        if c.failed_probes < policy.health_failures or c.proc is None:
            return
        c.failed_probes = 0
        c.unresponsive += 1
        pid = c.proc.pid
        c.proc.kill()
        self._restart_later(
            c,
            f"(pid {pid}, {c.url}) did not answer /health {policy.health_failures} times in a row "
            f"(every {policy.health_interval_s:g} s, {policy.probe_timeout_s:g} s each): hung, killed",
        )

    def _ready(self, c: _Child, url: str) -> None:
        assert c.proc is not None
        if c.ever_ready and url != c.url:
            log.warning("%s: %s moved from %s to %s", self.kind, c.spec.name, c.url, url)
            if c.url in self.urls:
                self.urls[self.urls.index(c.url)] = url
        if c.planned:
            log.info("%s: %s serves again at %s (pid %d, asked for)", self.kind, c.spec.name, url, c.proc.pid)
        elif c.ever_ready:
            log.warning(
                "%s: %s is back at %s (pid %d, restart %d)", self.kind, c.spec.name, url, c.proc.pid, c.restarts
            )
        c.planned = False
        c.url, c.state, c.ever_ready = url, ALIVE, True
        c.ready_count += 1
        c.port = urlsplit(url).port or 0
        c.failed_probes, c.next_probe = 0, time.monotonic() + self.restart.health_interval_s

    def _failed(self, c: _Child, why: str) -> None:
        """This start did not come up."""
        if c.proc is not None:
            c.proc.wait()
            c.proc = None
        where = f"its log ({c.spec.log_path})"
        if not c.ever_ready:
            c.state = FAILED
            if self._start_error is None:
                self._start_error = f"{c.spec.name} {why}; {where}:\n{c.tail()}"
            return
        if "cannot bind" in c.tail():  # the port was taken meanwhile: the next start takes any free one
            c.port = 0
        self._restart_later(c, f"restart {c.restarts} {why}")

    def _restart_later(self, c: _Child, why: str) -> None:
        """The child is down (`why`): schedule its restart, or give up on it."""
        c.last_failure = f"{c.spec.name} {why}"
        if c.proc is not None:
            c.proc.wait()  # reap it (no zombie)
            c.proc = None
        now = time.monotonic()
        policy = self.restart
        while c.recent and c.recent[0] < now - policy.window_s:
            c.recent.popleft()
        if len(c.recent) >= policy.max_restarts:
            c.state = GIVEN_UP
            c.reason = f"{c.spec.name} given up after {len(c.recent)} restart(s) within {policy.window_s:g} s: {why}"
            log.error("%s: %s; its log (%s):\n%s", self.kind, c.reason, c.spec.log_path, c.tail())
            return
        delay = policy.delay(len(c.recent))
        c.state, c.next_start = BACKOFF, now + delay
        log.warning(
            "%s: %s %s; restarting it in %.1f s on port %d (%d of at most %d within %g s)",
            self.kind,
            c.spec.name,
            why,
            delay,
            c.port,
            len(c.recent) + 1,
            policy.max_restarts,
            policy.window_s,
        )

    def _terminate_all(self) -> None:
        with self._lock:
            procs = [c.proc for c in self._children if c.proc is not None]
            for c in self._children:
                c.proc = None
                c.state = STOPPED if c.state != GIVEN_UP else c.state
        stop_processes(procs, self.grace_s)
