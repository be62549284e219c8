"""Per-task Python environments: sandboxed builds of an `EnvSpec` (`spec.py`; a task's
`[environment]` table, read by `env/tasks/envspec.py`), and a shared cache. What a task has to do
with it (its environment, building every task's) is `env/tasks/task_env.py`: this module knows
specs, not tasks.

A task may declare the Python it runs under::

    [environment]
    python = "3.11"                      # optional; default: the sandbox's python3
    requirements = ["attrs==23.2.0"]     # pip requirement lines, and/or
    requirements_file = "environment/requirements.txt"
    install_app = "editable"             # or "none" (default): pip install -e of environment/app

Each distinct spec is built once into `EnvCache.root/<key>` (`EnvSpec.key`: a sha256 over what
affects the build) and mounted read-only at `ENV_MOUNT` in every sandbox of the task, first on
PATH. Builds never happen in an agent's step: the server, `env validate` and `env build` build
every task's environment up front; a session of a task whose build failed gets the build's error.

A build runs untrusted code (setup.py, a build backend), so it runs in the same sandbox as the
agent, as a fresh lease's unprivileged uid: the entry's temporary directory is the only writable
mount (at `ENV_MOUNT`: a venv hard-codes its path), the wheelhouse is mounted read-only at
/wheelhouse, the requirements at /envreq, a copy of the app at /app (editable installs point
there, which is where sessions see their workspace). From a wheelhouse the build has no network;
without one it installs from the package sources of the machine's pip configuration
(`pip_sources.py`: index, extra indexes, find-links, certificate bundle, trusted hosts,
constraints; `index_url` replaces the index), given to pip and uv as options (the build reads no
configuration of its own), its network hosts reached through the index proxy (`index_proxy.py`:
those hosts only, at the addresses they resolved to when the run first built from them; the build
never shares the host's network, so its loopback services, private ranges and the link-local
metadata address stay out of reach). Then the entry is made read-only, owned by root, and renamed
into place.

pytest: when the spec's Python is the server's own, the venv gets a `.pth` line that puts the
verifier toolchain's site-packages (`toolchain.py`, at /opt/verifier in every sandbox: pytest,
pip, setuptools, wheel; never the server's own environment) *after* its own, so the verifier's
`python3 -m pytest` works and the task's requirements win over anything there; pip and setuptools
come from there too (builds use `--no-build-isolation`, so an offline build needs no build backend
in the wheelhouse). Under another Python, pytest must be among the requirements (the build checks it).
A pytest the spec installs (one resolved as of a date) comes before the toolchain's: it runs the tests.

As of a date (`exclude_newer`, `pins`; `resolution_mode`): a spec with pins installs exactly them
with `--no-deps`; one with `exclude_newer` and no pins is resolved by uv (`--exclude-newer`, the
`uv` binary of locks/env.lock mounted read-only at UV_MOUNT, the proxy given as HTTP(S)_PROXY)
against the index's upload times. The build reports every distribution it installed into the venv
(`BuiltEnv.installed`, the app excepted), which the miner records as the task's pins. The app is
installed after the requirements, with `--no-deps` in those two modes, so a build backend among the
requirements is there when the app is built.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from composer_jax.env.sandbox import index_proxy, pip_sources, toolchain, volumes
from composer_jax.env.sandbox.runner import Limits, Mount, Sandbox, SandboxLease
from composer_jax.env.sandbox.spec import EnvSpec

ENV_MOUNT = "/opt/taskenv"
RECIPE_VERSION = "3"  # bump when the build recipe changes: every key changes with it (3: uv compiles bytecode)
META_FILE = ".composer-jax-env.json"
BUILD_LIMITS = Limits(
    wall_seconds=900.0,
    cpu_seconds=900,
    memory_mb=4096,
    processes=256,
    file_size_mb=1024,
    open_files=1024,
    tmp_mb=1024,
    output_bytes=256 * 1024,
)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "composer_jax" / "envs"


def spec_key(spec: EnvSpec, app_dir: Path | None, source_id: str) -> str:
    """sha256 over everything that affects the build: the recipe, the spec, where packages come
    from (`source_id`), the server environment the venv sits over, and the app when editable."""
    h = hashlib.sha256()
    parts = [RECIPE_VERSION, spec.python or "", "\n".join(spec.requirements), spec.install_app, source_id]
    parts += [spec.app_version or "", spec.exclude_newer or "", "\n".join(spec.pins)]
    parts.append(_server_site_packages() if spec.python in (None, _server_python()) else "")
    for p in parts:
        h.update(p.encode() + b"\0")
    if spec.install_app == "editable" and app_dir is not None:
        h.update(tree_digest(app_dir).encode())
    return h.hexdigest()


def tree_digest(root: Path) -> str:
    """sha256 over the relative paths, modes and contents of a (trusted) tree; symlinks by target."""
    h = hashlib.sha256()
    if not root.is_dir():
        return h.hexdigest()
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]):
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            h.update(os.path.relpath(path, root).encode() + b"\0" + str(stat.S_IMODE(st.st_mode)).encode())
            if stat.S_ISLNK(st.st_mode):
                h.update(b"L" + os.readlink(path).encode())
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()


def _server_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _server_site_packages() -> str:
    """What a same-Python task environment sits over: the toolchain's site-packages as sandboxes
    see it, keyed by the toolchain's contents (a new pytest or pip rebuilds the environments)."""
    return toolchain.site_packages(toolchain.TOOLCHAIN_MOUNT) + "#" + toolchain.toolchain_key(toolchain.distributions())


class EnvBuildError(Exception):
    """A build that failed; `log_tail` is the end of its output."""

    def __init__(self, reason: str, log_tail: str = ""):
        super().__init__(reason + (f"\n--- build log (tail) ---\n{log_tail}" if log_tail else ""))
        self.reason, self.log_tail = reason, log_tail


@dataclasses.dataclass(frozen=True)
class BuiltEnv:
    key: str
    host_path: Path
    python_version: str
    requirements: tuple[str, ...]
    prefix: str = ENV_MOUNT  # where commands see it (the mount; a venv only works at its build path)
    base_path: str = "/usr/local/bin:/usr/bin:/bin"  # the sandbox's own PATH, after the env's bin
    # name==version of every distribution the build installed into the venv itself (not the app,
    # not the toolchain's): what `pins` records so the task rebuilds identically
    installed: tuple[str, ...] = ()
    pytest: str = ""  # the version `import pytest` finds in the environment: the one that runs the tests

    def mount(self) -> Mount:
        return Mount(self.host_path, ENV_MOUNT, writable=False)

    def env_vars(self) -> dict[str, str]:
        return {"PATH": f"{self.prefix}/bin:{self.base_path}", "VIRTUAL_ENV": self.prefix}

    def describe(self) -> dict:
        out = {"key": self.key, "python": self.python_version, "requirements": list(self.requirements)}
        return out | ({"pytest": self.pytest} if self.pytest else {})  # the pytest that ran the tests


_PLUGIN_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def pytest_plugins(env: BuiltEnv) -> tuple[str, ...]:
    """The pytest plugins the environment's own distributions register (entry point group
    `pytest11`, the app installed into it included), as module names: what pytest run there would
    autoload. Sandboxes disable autoloading (PYTEST_DISABLE_PLUGIN_AUTOLOAD), so a task that needs
    them names them in `[verifier] pytest_plugins` (loaded by name, PYTEST_PLUGINS)."""
    import importlib.metadata as md

    sites = [str(p) for p in sorted(env.host_path.glob("lib/python*/site-packages"))]
    if not sites:
        return ()
    registered = (ep for dist in md.distributions(path=sites) for ep in dist.entry_points if ep.group == "pytest11")
    names = {ep.value.split(":")[0].strip() for ep in registered}
    return tuple(sorted(n for n in names if _PLUGIN_MODULE.fullmatch(n)))


# The build, run inside the sandbox: $1 interpreter, $2 env prefix, $3 "pth" or "", $4 toolchain
# site-packages, $5 "editable" or "", $6 the index proxy's forwarder port or "" (index_proxy.py), $7
# the forwarder's code, $8 the mode (`resolution_mode`), $9 uv's path in the sandbox or "", then pip's
# package source options (--index-url, --no-index --find-links, --cert...), UV_SEPARATOR, and uv's.
# CJ_EXCLUDE_NEWER holds the cutoff of a dated resolution. Output: log, last line JSON (python,
# pytest, installed).
UV_SEPARATOR = "::uv::"
_BUILD_SCRIPT = r"""
set -eu
py="$1"; prefix="$2"; pth="$3"; site="$4"; editable="$5"; proxy="$6"; forwarder="$7"; mode="$8"; uv="$9"
shift 9
pipsrc=(); uvsrc=(); later=""
for a in "$@"; do
  if [ "$a" = "::uv::" ]; then later=1; elif [ -n "$later" ]; then uvsrc+=("$a"); else pipsrc+=("$a"); fi
done
pipproxy=""
if [ -n "$proxy" ]; then
  "$py" -c "$forwarder" /run/index-proxy/proxy.sock "$proxy" > /tmp/forwarder.out 2>&1 &
  for _ in $(seq 100); do grep -q ready /tmp/forwarder.out 2>/dev/null && break; sleep 0.05; done
  pipproxy="--proxy=http://127.0.0.1:$proxy"
  export HTTP_PROXY="http://127.0.0.1:$proxy" HTTPS_PROXY="http://127.0.0.1:$proxy" ALL_PROXY="http://127.0.0.1:$proxy"
  export http_proxy="$HTTP_PROXY" https_proxy="$HTTP_PROXY" NO_PROXY="" no_proxy=""
fi
if [ -n "$pth" ]; then "$py" -m venv --without-pip "$prefix"; else "$py" -m venv "$prefix"; fi
envpy="$prefix/bin/python"
if [ -n "$pth" ]; then
  purelib=$("$envpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  printf '%s\n' "$site" > "$purelib/_composer_jax_server_env.pth"
fi
uvi() {
  UV_NO_CONFIG=1 UV_PYTHON_DOWNLOADS=never "$uv" pip install --python "$envpy" --no-cache --no-build-isolation \
    --compile-bytecode "$@"
}
pipi() {
  "$envpy" -m pip install --no-cache-dir --disable-pip-version-check --no-input --no-build-isolation $pipproxy "$@"
}
if [ -s /envreq/requirements.txt ]; then
  case "$mode" in
    pins) if [ -n "$uv" ]; then uvi --no-deps "${uvsrc[@]}" -r /envreq/requirements.txt
          else pipi --no-deps --ignore-installed "${pipsrc[@]}" -r /envreq/requirements.txt; fi ;;
    dated) uvi --exclude-newer "$CJ_EXCLUDE_NEWER" "${uvsrc[@]}" -r /envreq/requirements.txt ;;
    *) pipi "${pipsrc[@]}" -r /envreq/requirements.txt ;;
  esac
fi
if [ -n "$editable" ]; then
  if [ "$mode" = plain ]; then pipi "${pipsrc[@]}" -e /app; else pipi --no-deps "${pipsrc[@]}" -e /app; fi
fi
"$envpy" - <<'PY'
import importlib.metadata as md, json, sys, sysconfig
import pytest
paths = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
own = set()
for dist in md.distributions(path=paths):
    if '"dir_info"' in (dist.read_text("direct_url.json") or ""):
        continue  # the app itself, installed from /app
    own.add(f"{dist.metadata['Name']}=={dist.version}")
facts = {"python": "%d.%d.%d" % sys.version_info[:3], "pytest": pytest.__version__}
print(json.dumps({**facts, "installed": sorted(own, key=str.lower)}))
PY
"""
UV_MOUNT = "/opt/uv/uv"  # where a dated build sees the uv binary (read-only)


def resolution_mode(spec: EnvSpec, from_wheelhouse: bool) -> str:
    """How a build installs `spec`'s requirements: "pins" (exactly the pins, no resolution), "dated"
    (uv resolves as of `exclude_newer` from an index's upload times), or "plain" (pip resolves: no
    cutoff, or a wheelhouse, which has no upload times: its owner chose its versions)."""
    if spec.pins:
        return "pins"
    return "dated" if spec.exclude_newer and not from_wheelhouse else "plain"


def find_uv() -> Path | None:
    """The uv binary (locks/env.lock pins the `uv` package): its package's, else uv on PATH."""
    try:
        from uv import find_uv_bin

        return Path(find_uv_bin())
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        return Path(found) if found else None


class EnvCache:
    """Built environments under `root`, one directory per key; builds run in `sandbox`."""

    def __init__(
        self,
        root: Path,
        sandbox: Sandbox,
        *,
        wheelhouse: Path | None = None,
        index_url: str | None = None,
        proxy_allow: tuple[tuple[str, int], ...] = (),
        sources: pip_sources.PipSources | None = None,
    ):
        self.root = Path(root)
        # (host, port) pairs builds may reach besides the package sources' (`--index-proxy-allow`)
        self.proxy_allow = proxy_allow
        # the package sources (pip_sources.py): read from pip's configuration on the first index build
        self._sources = sources
        # (host, port) -> its addresses, or why it did not resolve: pinned for the life of this cache
        self._pins: dict[tuple[str, int], tuple[str, ...] | str] = {}
        # what kept builds from their packages (a proxy refusal, an untrusted certificate), with the
        # flag or setting that changes it -> builds it failed: the run's summary names them
        self.source_problems: dict[str, int] = {}
        self.sandbox = sandbox
        self.wheelhouse = Path(wheelhouse).resolve() if wheelhouse is not None else None
        self.index_url = index_url
        if self.wheelhouse is not None and not self.wheelhouse.is_dir():
            raise ValueError(f"--wheelhouse {wheelhouse}: not a directory")
        if index_url is not None and not re.match(r"^https?://[^\s/]+", index_url):
            raise ValueError(f"--index-url {index_url!r}: expected an http:// or https:// URL")
        self._built: dict[str, BuiltEnv] = {}
        self._failed: dict[str, EnvBuildError] = {}
        self._inflight: dict[str, asyncio.Future[BuiltEnv]] = {}
        self._source_id: str | None = None
        self.build_seconds: dict[str, float] = {}  # key -> seconds its build took (hits: absent)
        self.builds: dict[str, int] = {}  # builds this object ran, by outcome (ok, failed): /metrics

    def counts(self) -> dict[str, int]:
        """Environments known here, by state: built (in memory: built or found on disk) and failed."""
        return {"built": len(self._built), "failed": len(self._failed)}

    def source_id(self) -> str:
        """Where packages come from, as part of every key: computed once, on first use (a session's
        lookup must not list a large wheelhouse each time)."""
        if self._source_id is None:
            self._source_id = self._compute_source_id()
        return self._source_id

    def _compute_source_id(self) -> str:
        if self.wheelhouse is not None:
            names = sorted(f"{p.name}:{p.stat().st_size}" for p in self.wheelhouse.iterdir() if p.is_file())
            return "wheelhouse:" + hashlib.sha256("\n".join(names).encode()).hexdigest()
        return f"index:{self.index_url or 'pip-default'}"

    def key_of(self, spec: EnvSpec, app_dir: Path | None) -> str:
        return spec_key(spec, app_dir, self.source_id())

    def lookup(self, spec: EnvSpec, app_dir: Path | None) -> BuiltEnv:
        """The built environment of `spec` without building; raises the build's EnvBuildError, or
        EnvBuildError when it was never built (sessions never build)."""
        key = self.key_of(spec, app_dir)
        if key in self._failed:
            raise self._failed[key]
        found = self._built.get(key) or self._from_disk(key, spec)
        if found is None:
            raise EnvBuildError(
                f"its Python environment ({key[:12]}) is not built; the server builds every task's environment "
                "at start-up (`composer-jax env build TASKS` pre-builds), never inside a step"
            )
        return found

    async def ensure(self, spec: EnvSpec, app_dir: Path | None) -> BuiltEnv:
        """The built environment of `spec`: from memory or disk, else built once (concurrent callers
        wait for the same build; a failure is remembered and raised again without rebuilding)."""
        key = self.key_of(spec, app_dir)
        if key in self._failed:
            raise self._failed[key]
        found = self._built.get(key) or self._from_disk(key, spec)
        if found is not None:
            return found
        if key in self._inflight:
            return await asyncio.shield(self._inflight[key])
        fut: asyncio.Future[BuiltEnv] = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        try:
            built = await self._build(key, spec, app_dir)
        except EnvBuildError as exc:
            self._failed[key] = exc
            self.builds["failed"] = self.builds.get("failed", 0) + 1
            fut.set_exception(exc)
            fut.exception()  # retrieved: there may be no other waiter
            raise
        except BaseException as exc:
            fut.set_exception(EnvBuildError(f"building the environment {key[:12]} was interrupted: {exc!r}"))
            fut.exception()
            raise
        finally:
            del self._inflight[key]
        self._built[key] = built
        self.builds["ok"] = self.builds.get("ok", 0) + 1
        fut.set_result(built)
        return built

    def _from_disk(self, key: str, spec: EnvSpec) -> BuiltEnv | None:
        path = self.root / key
        try:
            meta = json.loads((path / META_FILE).read_text())
        except (OSError, ValueError):
            return None
        built = self._built_env(key, path, meta, spec)
        self._built[key] = built
        return built

    def _built_env(self, key: str, path: Path, facts: dict, spec: EnvSpec) -> BuiltEnv:
        base = getattr(self.sandbox, "path_env", os.environ.get("PATH", "/usr/bin:/bin"))
        installed = tuple(str(x) for x in facts.get("installed", ()))
        python, pytest = str(facts.get("python", "")), str(facts.get("pytest", ""))
        return BuiltEnv(key, path, python, spec.requirements, base_path=base, installed=installed, pytest=pytest)

    def interpreter(self, spec: EnvSpec) -> str:
        """The interpreter a build of `spec` uses, as a path the sandbox shows; EnvBuildError if none."""
        if spec.python in (None, _server_python()):
            # The server's own interpreter (a venv's base) where the sandbox shows it.
            shown = getattr(self.sandbox, "python_executable", None)
            return shown() if shown is not None else os.path.realpath(getattr(sys, "_base_executable", sys.executable))
        found = _visible_python(self.sandbox, spec.python)
        if found is None:
            have = sorted({m.group(0) for d in _path_dirs(self.sandbox) for m in _versions_in(d)})
            raise EnvBuildError(
                f"python = {spec.python!r}: no python{spec.python} in the sandbox (it shows the host's /usr and the "
                f"server's Python); available: {', '.join(have) or 'none'}"
            )
        return found

    async def _build(self, key: str, spec: EnvSpec, app_dir: Path | None) -> BuiltEnv:
        start = time.monotonic()
        if not self.sandbox.isolated:
            # A venv hard-codes its path: it is built at ENV_MOUNT, which only a mount namespace gives.
            raise EnvBuildError("per-task Python environments need the bubblewrap sandbox (not --unsafe-no-sandbox)")
        py = self.interpreter(spec)
        self.root.mkdir(parents=True, exist_ok=True)  # here, not at start-up: most servers build nothing
        await asyncio.to_thread(sweep_stale_builds, self.root)
        work = Path(tempfile.mkdtemp(prefix=f".build-{key[:12]}-", dir=self.root))
        try:
            entry = work / "env"
            lease = self.sandbox.lease(f"envbuild-{key[:12]}-{secrets.token_hex(4)}")
            try:
                facts = await self._run_build(lease, work, key, spec, app_dir, py)
            finally:
                await lease.close()  # every process of the build is dead before its tree is walked
            meta = {"key": key, "requirements": list(spec.requirements)}
            meta |= {k: facts.get(k, d) for k, d in (("python", ""), ("pytest", ""), ("installed", []))}
            await asyncio.to_thread(_seal, entry, lease.uid, meta)
            final = self.root / key
            try:
                os.rename(entry, final)
            except OSError:
                if not (final / META_FILE).is_file():  # another server's build landed first: use it
                    raise
        finally:
            await asyncio.to_thread(volumes.remove_tree, work)  # inputs, the app copy, a failed entry
        self.build_seconds[key] = round(time.monotonic() - start, 2)
        return self._built_env(key, final, meta, spec)

    async def _run_build(
        self, lease: SandboxLease, work: Path, key: str, spec: EnvSpec, app_dir: Path | None, py: str
    ) -> dict:
        """Run the build in the sandbox (see the module docstring); its facts, or EnvBuildError."""
        entry, inputs, app = work / "env", work / "inputs", work / "app"
        for d in (entry, inputs, app):
            d.mkdir(mode=0o755)
        _chown(entry, lease.uid, lease.gid)
        mode = resolution_mode(spec, self.wheelhouse is not None)
        wanted = spec.pins if mode == "pins" else spec.requirements
        (inputs / "requirements.txt").write_text("".join(r + "\n" for r in wanted))
        mounts = [Mount(entry, ENV_MOUNT, True), Mount(inputs, "/envreq", False)]
        if spec.install_app == "editable":
            if app_dir is None or not app_dir.is_dir():
                raise EnvBuildError("install_app = 'editable' but the task has no environment/app/")
            _chown(app, lease.uid, lease.gid)
            await asyncio.to_thread(volumes.copy_tree, app_dir, app, lease.uid, lease.gid)
            mounts.append(Mount(app, "/app", True))
        # the build reads no pip configuration: its sources are the options it is given
        env = {"CJ_EXCLUDE_NEWER": spec.exclude_newer or "", "PIP_CONFIG_FILE": os.devnull}
        if spec.app_version:
            env["SETUPTOOLS_SCM_PRETEND_VERSION"] = spec.app_version  # no .git in the app (setuptools-scm, hatch-vcs)
        uv = ""
        found = find_uv() if mode in ("dated", "pins") else None  # pins: uv if there, else pip (slower)
        if found is not None:
            mounts.append(Mount(found, UV_MOUNT, False))
            uv = UV_MOUNT
        elif mode == "dated":
            raise EnvBuildError("exclude_newer: resolving as of a date needs uv (the `uv` package, locks/env.lock)")
        same_python = spec.python in (None, _server_python())
        flags = [
            "pth" if same_python else "",
            toolchain.site_packages(toolchain.TOOLCHAIN_MOUNT),
            spec.install_app.replace("none", ""),
        ]
        tail = [mode, uv]
        if self.wheelhouse is not None:
            mounts.append(Mount(self.wheelhouse, "/wheelhouse", False))
            offline = ["--no-index", "--find-links", "/wheelhouse"]
            source = [*offline, UV_SEPARATOR, *offline]
        elif wanted or spec.install_app == "editable":
            return await self._run_with_index(lease, key, [*mounts], [py, ENV_MOUNT, *flags], tail, env)
        else:
            source = []
        return await self._run_script(lease, key, mounts, [py, ENV_MOUNT, *flags, "", "", *tail], source, None, env)

    def package_sources(self) -> pip_sources.PipSources:
        """The sources index builds use: pip's configuration (read once), `index_url` its index."""
        if self._sources is None:
            try:
                self._sources = pip_sources.read()
            except pip_sources.PipConfigError as exc:
                raise EnvBuildError(str(exc)) from None
        return self._sources.with_index(self.index_url) if self.index_url else self._sources

    async def _pinned(self, hosts: Iterable[tuple[str, int]]) -> dict[tuple[str, int], tuple[str, ...] | str]:
        """{host: pinned addresses} for `hosts`, each resolved on its first build of this cache."""
        new = [h for h in hosts if h not in self._pins]
        if new:
            for host, pinned in (await asyncio.to_thread(index_proxy.pin, new)).items():
                self._pins.setdefault(host, pinned)  # a concurrent build's first resolution stands
        return {h: self._pins[h] for h in hosts}

    async def _run_with_index(
        self, lease: SandboxLease, key: str, mounts: list[Mount], head: list[str], tail: list[str], env: dict
    ) -> dict:
        """A build from the package sources (`package_sources`): no network of its own, their hosts
        through the proxy only, their local paths bound read-only."""
        try:
            plan = pip_sources.plan(self.package_sources())
        except pip_sources.PipConfigError as exc:
            raise EnvBuildError(str(exc)) from None
        mounts += [Mount(host, dest, False) for host, dest in plan.binds]
        source = [*plan.pip_args, UV_SEPARATOR, *plan.uv_args]
        if not plan.hosts and not self.proxy_allow:  # local sources only: no proxy, no network
            args = [*head, "", "", *tail]
            return await self._run_script(lease, key, mounts, args, source, None, env)
        proxy = index_proxy.IndexProxy(await self._pinned(sorted(plan.hosts | set(self.proxy_allow))))
        async with proxy.serving() as where:
            mounts.append(Mount(where, index_proxy.MOUNT, False))
            args = [*head, str(index_proxy.PORT), index_proxy.FORWARDER, *tail]
            try:
                return await self._run_script(lease, key, mounts, args, source, proxy, env)
            finally:
                for refusal in dict.fromkeys(proxy.refused):
                    self.source_problems[refusal] = self.source_problems.get(refusal, 0) + 1

    async def _run_script(
        self,
        lease: SandboxLease,
        key: str,
        mounts: list[Mount],
        args: list[str],
        source: list[str],
        proxy: index_proxy.IndexProxy | None,
        env: dict,
    ) -> dict:
        argv = ["bash", "-c", _BUILD_SCRIPT, "build", *args, *source]
        result = await lease.run(argv, mounts=mounts, cwd="/", limits=BUILD_LIMITS, network=False, env=env)
        log = (result.stdout + result.stderr)[-6000:]
        if result.timed_out or result.exit_code != 0:
            why = "timed out" if result.timed_out else f"exit {result.exit_code}"
            hint = " (no pytest: under another Python than the server's, list pytest in requirements)"
            refused = f"; the index proxy refused: {'; '.join(proxy.refused[:5])}" if proxy and proxy.refused else ""
            untrusted = _untrusted_certificate(result.stdout + result.stderr)
            if untrusted:
                self.source_problems[untrusted] = self.source_problems.get(untrusted, 0) + 1
            raise EnvBuildError(
                f"building the environment {key[:12]} failed ({why}){refused}"
                + (f"; {untrusted}" if untrusted else "")
                + (hint if "No module named 'pytest'" in log[-400:] else ""),
                log,
            )
        return _last_json(result.stdout)


# what pip (CERTIFICATE_VERIFY_FAILED) and uv (UnknownIssuer...) print for a certificate they do not trust
_TLS_FAILURES = ("CERTIFICATE_VERIFY_FAILED", "invalid peer certificate", "UnknownIssuer")


def _untrusted_certificate(log: str) -> str:
    """The problem and its remedy when a build failed on a package source's certificate, else ""."""
    if not any(mark in log for mark in _TLS_FAILURES):
        return ""
    return (
        "a package source's certificate is not trusted: name its authority in pip's configuration "
        "(`pip config set global.cert BUNDLE`, or PIP_CERT), which builds use as pip does"
    )


def sweep_stale_builds(root: Path, max_age_s: float = 2 * BUILD_LIMITS.wall_seconds) -> list[str]:
    """Remove `.build-*` directories older than any live build can be (a server killed mid-build
    left them; a build in progress, here or in another server, is younger than its wall limit)."""
    removed = []
    now = time.time()
    for p in root.glob(".build-*"):
        try:
            old = now - p.lstat().st_mtime > max_age_s
        except OSError:
            continue
        if old:
            volumes.remove_tree(p)
            removed.append(p.name)
    return removed


def _path_dirs(sandbox: Sandbox) -> list[str]:
    return getattr(sandbox, "path_env", os.environ.get("PATH", "")).split(":")


def _versions_in(d: str) -> Iterable[re.Match[str]]:
    try:
        names = os.listdir(d)
    except OSError:
        return []
    return [m for n in names if (m := re.fullmatch(r"python3\.\d+", n))]


def _visible_python(sandbox: Sandbox, version: str) -> str | None:
    for d in _path_dirs(sandbox):
        p = os.path.join(d, f"python{version}")
        if os.access(p, os.X_OK):
            return p
    return None


def _chown(path: Path, uid: int, gid: int) -> None:
    if os.geteuid() == 0:
        os.chown(path, uid, gid)


def _seal(entry: Path, build_uid: int, meta: dict) -> None:
    """Make a finished build read-only and root's. The build's processes are dead (its lease is
    closed), so nothing changes the tree while it is walked. Entries are examined by lstat and
    never followed: symlinks are left as they are, and anything not a plain directory or a
    regular file of the build's own (a FIFO, a device, a hard link to a file of someone else,
    which could be a host file) is removed rather than touched."""
    as_root = os.geteuid() == 0
    for dirpath, dirs, files in os.walk(entry, topdown=False):
        for name in files + dirs:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                if as_root:
                    os.chown(path, 0, 0, follow_symlinks=False)  # the link itself, never its target
                continue
            foreign = as_root and st.st_uid != build_uid
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)) or (stat.S_ISREG(st.st_mode) and foreign):
                os.unlink(path)
                continue
            if stat.S_ISDIR(st.st_mode) and foreign:
                shutil.rmtree(path)
                continue
            mode = (stat.S_IMODE(st.st_mode) & 0o555) | (0o555 if stat.S_ISDIR(st.st_mode) else 0o444)
            os.chmod(path, mode, follow_symlinks=False)
            if as_root:
                os.chown(path, 0, 0, follow_symlinks=False)
    # The build may have planted its own META_FILE (a symlink to a host file, say): remove it and
    # create ours afresh, never following a link.
    planted = entry / META_FILE
    if planted.is_dir() and not planted.is_symlink():
        shutil.rmtree(planted)
    elif os.path.lexists(planted):
        os.unlink(planted)
    fd = os.open(planted, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(meta))
    os.chmod(entry, 0o555)
    if as_root:
        os.chown(entry, 0, 0)


def _last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return {}
