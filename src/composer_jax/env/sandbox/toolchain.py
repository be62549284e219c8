"""The verifier's toolchain: a Python environment of its own, at a neutral path in every sandbox.

A sandbox shows the host's `/usr`, `/etc` and the Python installation the server runs on, never the
server's own virtualenv (which lives in its project directory and holds the whole server: JAX, the
project, its keys' readers). What sandboxed commands need of Python beyond the standard library is
pytest (the verifiers, and agents running the tests), and for task environment builds
(`pyenv.py`) pip, setuptools and wheel where the server has them. `toolchain()` builds that environment once per key: a
virtualenv over the server's base interpreter holding copies of exactly those distributions and
what they require (the installed files of each, as the host's own installation has them: no
network), made read-only and mounted at `TOOLCHAIN_MOUNT` first on the sandbox's PATH, so
`python3 -m pytest` and `pytest` work there and nothing else of the host's environments shows.

A virtualenv finds its prefix from where its interpreter is run (its `pyvenv.cfg` beside `bin/`),
so one built at a host path runs at the mount; the `pytest` script is written for the mount.
"""

from __future__ import annotations

import compileall
import hashlib
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TOOLCHAIN_MOUNT = "/opt/verifier"
ROOTS = ("pytest",)
OPTIONAL = ("pip", "setuptools", "wheel")  # taken when installed (task environment builds use them)
RECIPE = "2"  # 2: bytecode compiled at build time
MARKER = ".composer_jax_toolchain"


class ToolchainError(RuntimeError):
    """The toolchain cannot be built from this host's installation (a distribution is missing)."""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def distributions(roots: tuple[str, ...] = ROOTS) -> list[md.Distribution]:
    """`roots`, the OPTIONAL ones installed here, and everything they require (markers evaluated for
    this interpreter, no extras); ToolchainError naming a root or requirement that is not installed."""
    from packaging.requirements import Requirement

    found: dict[str, md.Distribution] = {}
    todo = list(roots) + [n for n in OPTIONAL if _installed(n)]
    while todo:
        name = _norm(todo.pop())
        if name in found:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise ToolchainError(
                f"the verifier toolchain needs {name!r}, which the server's Python environment does not have "
                "(install pytest into it)"
            ) from None
        found[name] = dist
        for line in dist.requires or ():
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return [found[k] for k in sorted(found)]


def _installed(name: str) -> bool:
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        return False
    return True


def toolchain_key(dists: list[md.Distribution], python_prefix: str | None = None) -> str:
    h = hashlib.sha256(f"{RECIPE}\0{sys.version}\0{_base_python()}\0{python_prefix}\0".encode())
    for d in dists:
        h.update(f"{_norm(d.metadata['Name'])}=={d.version}\0".encode())
    return h.hexdigest()[:16]


def _base_python() -> str:
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def default_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "composer_jax" / "toolchain"


def site_packages(prefix: str | Path) -> str:
    """The toolchain's site-packages under `prefix` (the mount, or the host path)."""
    return f"{prefix}/lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"


def toolchain(root: Path | None = None, python_prefix: str | None = None) -> Path:
    """The host directory of the toolchain (built on first use, then reused): mount it read-only at
    TOOLCHAIN_MOUNT. `python_prefix`: where sandboxes see the base Python installation (its
    interpreter links there); None, its host path. Safe against concurrent builders (each builds
    aside, the first rename wins)."""
    dists = distributions()
    root = root or default_root()
    final = root / toolchain_key(dists, python_prefix)
    if (final / MARKER).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        _build(work, dists, python_prefix)
        try:
            os.rename(work, final)
        except OSError:
            if not (final / MARKER).is_file():
                raise
    finally:
        if work.exists():
            _make_writable(work)
            shutil.rmtree(work, ignore_errors=True)
    return final


def _build(prefix: Path, dists: list[md.Distribution], python_prefix: str | None) -> None:
    subprocess.run([_base_python(), "-m", "venv", "--without-pip", str(prefix)], check=True, capture_output=True)
    if python_prefix is not None:
        _relocate_base(prefix, python_prefix)
    site = Path(site_packages(prefix))
    for dist in dists:
        _copy_distribution(dist, site)
    # The toolchain is mounted read-only, so bytecode it lacks is compiled on every import in every
    # sandbox (pytest's alone: ~0.4 s of each grade). Compiled here once, named for the mount.
    compileall.compile_dir(str(site), ddir=site_packages(TOOLCHAIN_MOUNT), quiet=1)
    for f in (prefix / "bin").glob("[Aa]ctivate*"):  # they name the host path it was built at
        f.unlink()
    cfg = prefix / "pyvenv.cfg"  # keep what the interpreter reads; `command` names the host path
    cfg.write_text("".join(ln for ln in cfg.read_text().splitlines(True) if not ln.startswith("command")))
    script = prefix / "bin" / "pytest"
    script.write_text(f"#!{TOOLCHAIN_MOUNT}/bin/python3\nimport sys\n\nfrom pytest import console_main\n\n")
    with script.open("a") as out:
        out.write("sys.exit(console_main())\n")
    script.chmod(0o755)
    (prefix / MARKER).write_text("\n".join(f"{d.metadata['Name']}=={d.version}" for d in dists) + "\n")
    for dirpath, _, files in os.walk(prefix):
        for name in files:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, 0o555 if os.access(p, os.X_OK) else 0o444)
        os.chmod(dirpath, 0o555)


def _relocate_base(prefix: Path, python_prefix: str) -> None:
    """Point the virtualenv at the base Python where sandboxes see it: its interpreter links and
    pyvenv.cfg's `home` / `executable`."""
    host_bin = str(Path(_base_python()).parent)
    for link in (prefix / "bin").iterdir():
        if link.is_symlink() and os.readlink(link).startswith(host_bin + "/"):
            target = f"{python_prefix}/bin/{Path(os.readlink(link)).name}"
            link.unlink()
            link.symlink_to(target)
    cfg = prefix / "pyvenv.cfg"
    cfg.write_text(cfg.read_text().replace(host_bin, f"{python_prefix}/bin"))


def _copy_distribution(dist: md.Distribution, site: Path) -> None:
    """The distribution's installed files that live in its site-packages (its package, its
    .dist-info; not its console scripts, written for the host's paths), copied under `site`."""
    base = Path(str(dist.locate_file(""))).resolve()
    for f in dist.files or ():
        src = Path(str(dist.locate_file(f))).resolve()
        if "__pycache__" in f.parts or not src.is_file() or base not in src.parents:
            continue
        dest = site / src.relative_to(base)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)


def _make_writable(root: Path) -> None:
    for dirpath, _, _ in os.walk(root):
        os.chmod(dirpath, 0o755)
