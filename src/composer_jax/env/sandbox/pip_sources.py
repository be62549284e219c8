"""Where an environment build gets packages: the machine's configuration as pip reads it.

`env mine`, `env build` and the env-server build task environments wherever `pip install` works
on the machine, with no flags. pip itself reads its configuration (`pip config list`, run with the
server's interpreter: the files pip reads, global, user, site and `PIP_CONFIG_FILE`, and the
`PIP_*` environment variables, in pip's own precedence) and `read()` keeps what decides where
packages come from and whom to trust: the index, extra indexes, find-links, `no-index`, the
certificate bundle, trusted hosts and constraint files. Sections are applied as pip applies them to
`pip install`: `[global]`, then `[install]`, then the environment (`PIP_CERT`...), later winning;
and, as pip's HTTP library (requests) does, `REQUESTS_CA_BUNDLE` or `CURL_CA_BUNDLE` when set
replaces the configured certificate bundle.

A build runs in the sandbox with no configuration of its own (`PIP_CONFIG_FILE=/dev/null`): `plan()`
turns these sources into the build's options, for pip and for uv alike (uv reads no pip
configuration), with every local path they name (a find-links folder, a file:// index, the
certificate bundle, a constraints file) bound read-only under `SOURCES_MOUNT` at its host path, and
the network hosts they name (each index's, a find-links URL's, PyPI's file host with PyPI) listed
for the index proxy (`index_proxy.py`), which pins each at the address it resolves to when the run
first builds from them. A file:// index is bound with its parent folder, where local index layouts
keep the files their pages link to (`simple/` beside `files/` or `packages/`).

Without a certificate bundle in the configuration pip trusts what it trusts by default (its own
bundle or, from pip 24.2, the system store), and uv is given `--system-certs`, the system store.
pip's `client-cert` is not carried (uv has no such option); a build from an index that asks for a
client certificate fails with the index's refusal.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import unquote, urlsplit

PYPI = "https://pypi.org/simple"
PYPI_FILES = ("files.pythonhosted.org", 443)  # PyPI's simple index links its files on this host
SOURCES_MOUNT = "/run/pip-sources"  # where a build sees the local paths of the configuration
# pip options that decide where packages come from, in `pip config list`'s spelling
KEYS = ("index-url", "extra-index-url", "find-links", "no-index", "cert", "trusted-host", "constraint")
SECTIONS = ("global", "install", ":env:")  # pip's order for `pip install`: a later section wins
_TRUE = ("1", "true", "yes", "y", "on")
# certificate bundles named in the environment that pip's requests session uses before pip's `cert`
BUNDLE_VARIABLES = ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")


class PipConfigError(ValueError):
    """pip's configuration cannot be read, or names a source a build cannot use."""


@dataclasses.dataclass(frozen=True)
class PipSources:
    """The package sources of pip's configuration (module docstring). `origin`: for each key that
    was set, where (`global`, `install`, or `:env:` for a `PIP_*` variable)."""

    index_url: str = PYPI
    extra_index_urls: tuple[str, ...] = ()
    find_links: tuple[str, ...] = ()
    no_index: bool = False
    cert: str | None = None
    trusted_hosts: tuple[str, ...] = ()
    constraints: tuple[str, ...] = ()
    origin: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def with_index(self, url: str) -> PipSources:
        """These sources with `url` as the index (`--index-url` on the command line: pip's own
        precedence, the extra indexes and the rest of the configuration stay)."""
        return dataclasses.replace(self, index_url=url, no_index=False, origin={**self.origin, "index-url": "flag"})

    def describe(self) -> str:
        """One line for a log: the index, the others, the certificate bundle."""
        parts = [f"index {self.index_url}" + (" (not used: no-index)" if self.no_index else "")]
        parts += [f"extra index {u}" for u in self.extra_index_urls]
        parts += [f"find-links {u}" for u in self.find_links]
        parts.append(f"cert {self.cert}" if self.cert else "default trust")
        return "; ".join(parts)


def parse_config_list(text: str) -> PipSources:
    """`pip config list`'s output (`section.key='value'` lines) as the sources pip install uses."""
    found: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        name, sep, raw = line.partition("=")
        section, dot, key = name.rpartition(".")
        if not sep or not dot or key not in KEYS or section not in SECTIONS:
            continue
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw.strip("'\"")
        found.setdefault(key, {})[section] = str(value)
    values: dict[str, str] = {}
    origin: dict[str, str] = {}
    for key, by_section in found.items():
        for section in SECTIONS:
            if section in by_section:
                values[key], origin[key] = by_section[section], section
    return PipSources(
        index_url=values.get("index-url", PYPI),
        extra_index_urls=tuple(values.get("extra-index-url", "").split()),
        find_links=tuple(values.get("find-links", "").split()),
        no_index=values.get("no-index", "").strip().lower() in _TRUE,
        cert=values.get("cert") or None,
        trusted_hosts=tuple(values.get("trusted-host", "").split()),
        constraints=tuple(values.get("constraint", "").split()),
        origin=origin,
    )


def read(python: str | None = None, environ: Mapping[str, str] | None = None) -> PipSources:
    """The sources as pip on this machine reads them (`python -m pip config list`, the server's
    interpreter by default). PipConfigError naming the command when pip cannot say."""
    argv = [python or sys.executable, "-m", "pip", "config", "list"]
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=60, env=dict(os.environ if environ is None else environ)
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PipConfigError(f"cannot read pip's configuration ({' '.join(argv)}): {exc}") from exc
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise PipConfigError(
            f"cannot read pip's configuration ({' '.join(argv[1:])} exited {proc.returncode}: {why}); "
            "give --index-url or --wheelhouse"
        )
    sources = parse_config_list(proc.stdout)
    env = os.environ if environ is None else environ
    for variable in BUNDLE_VARIABLES:
        if env.get(variable):
            # pip's HTTP library takes these over pip's own `cert` (requests' trust_env), so pip does
            return dataclasses.replace(sources, cert=env[variable], origin={**sources.origin, "cert": variable})
    return sources


@dataclasses.dataclass(frozen=True)
class BuildSources:
    """What a sandboxed build is given: `pip_args` / `uv_args` (the source options of each),
    `binds` (host path -> path in the sandbox, read-only) and `hosts` (host, port) for the proxy."""

    pip_args: tuple[str, ...]
    uv_args: tuple[str, ...]
    binds: tuple[tuple[Path, str], ...]
    hosts: frozenset[tuple[str, int]]


def in_sandbox(path: str | Path) -> str:
    """Where a host path is seen in a build's sandbox."""
    return SOURCES_MOUNT + str(Path(os.path.abspath(path)))


def plan(sources: PipSources) -> BuildSources:
    """The build's options for `sources` (module docstring); PipConfigError naming the option whose
    local path does not exist (the build would fail later with less to go on)."""
    binds: dict[Path, str] = {}
    hosts: set[tuple[str, int]] = set()

    def local(option: str, value: str, path: str, parent: bool = False) -> str:
        host = Path(os.path.abspath(path))
        if not host.exists():
            raise PipConfigError(
                f"pip's configuration ({sources.origin.get(option, 'flag')}) names {option} {value!r}: "
                f"{host} does not exist"
            )
        bound = host.parent if parent and host.is_dir() and host.parent != host else host
        binds.setdefault(bound, in_sandbox(bound))
        return in_sandbox(host)

    def url(option: str, value: str, index: bool) -> str:
        parts = urlsplit(value)
        if parts.scheme == "file":
            return "file://" + local(option, value, unquote(parts.path), parent=index)
        if parts.scheme in ("http", "https") and parts.hostname:
            host = parts.hostname.lower()
            hosts.add((host, parts.port or (443 if parts.scheme == "https" else 80)))
            if host == "pypi.org":
                hosts.add(PYPI_FILES)
            return value
        if index or "://" in value:
            raise PipConfigError(
                f"pip's configuration ({sources.origin.get(option, 'flag')}) names {option} {value!r}: "
                "expected an http://, https:// or file:// URL"
            )
        return local(option, value, value)  # find-links: a plain path

    common: list[str] = []
    if sources.no_index:
        common.append("--no-index")
    else:
        common += ["--index-url", url("index-url", sources.index_url, True)]
        for extra in sources.extra_index_urls:
            common += ["--extra-index-url", url("extra-index-url", extra, True)]
    for link in sources.find_links:
        common += ["--find-links", url("find-links", link, False)]
    for constraint in sources.constraints:
        common += ["-c", local("constraint", constraint, constraint)]
    pip_args, uv_args = list(common), list(common)
    if sources.cert:
        cert = local("cert", sources.cert, sources.cert)
        pip_args += ["--cert", cert]
        uv_args += ["--cert", cert]
    else:
        uv_args.append("--system-certs")
    for trusted in sources.trusted_hosts:
        pip_args += ["--trusted-host", trusted]
        uv_args += ["--allow-insecure-host", trusted]
    if len([a for a in common if a in ("--index-url", "--extra-index-url")]) > 1:
        # pip takes the best version over all its indexes; uv's default takes the first index that
        # has the project, and uv ranks --extra-index-url before --index-url
        uv_args += ["--index-strategy", "unsafe-best-match"]
    return BuildSources(tuple(pip_args), tuple(uv_args), _outermost(binds), frozenset(hosts))


def _outermost(binds: dict[Path, str]) -> tuple[tuple[Path, str], ...]:
    """The binds without those inside another (a read-only bind cannot hold a mount point)."""
    kept: list[tuple[Path, str]] = []
    for path in sorted(binds, key=lambda p: len(p.parts)):
        if not any(path.is_relative_to(outer) for outer, _ in kept):
            kept.append((path, binds[path]))
    return tuple(kept)
