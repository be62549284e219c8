"""Sandboxes and environment caches as the command lines configure them (`env-server`, `env validate`,
`env build`, `env mine`, `env import-swebench` share these flags and factories; building every task's
environment is `env/tasks/task_env.py`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from composer_jax.errors import UsageError


def make_sandbox(unsafe: bool, wall: float | None = None):
    """The sandbox the flags ask for; UsageError when there is none (no bubblewrap and no
    --unsafe-no-sandbox)."""
    from composer_jax.env.sandbox.runner import Limits, default_sandbox

    try:
        return default_sandbox(unsafe_no_sandbox=unsafe, limits=Limits(wall_seconds=wall or 30.0))
    except RuntimeError as exc:
        raise UsageError(str(exc)) from exc


def add_env_cache_flags(p: argparse.ArgumentParser) -> None:
    """--env-cache, --wheelhouse, --index-url: where tasks' Python environments (pyenv.py) are built from and
    kept. Without --wheelhouse, builds take their packages where the machine's pip does (pip_sources.py)."""
    p.add_argument(
        "--env-cache",
        type=Path,
        default=None,
        help="directory of built task Python environments (default ~/.cache/composer_jax/envs)",
    )
    p.add_argument("--wheelhouse", type=Path, help="build environments offline from this directory of wheels/sdists")
    p.add_argument(
        "--index-url",
        help="build environments from this package index instead of pip's configured one (the rest of pip's "
        "configuration, extra indexes, find-links, certificate bundle, still applies)",
    )
    p.add_argument(
        "--index-proxy-allow",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="let builds reach this host too, besides the package sources of pip's configuration (an index "
        "whose pages link files on another host); pinned at its address like them (index_proxy.py); repeatable",
    )


def make_env_cache(args: argparse.Namespace, sandbox):
    """The EnvCache the flags describe; UsageError when they cannot be used (a bad --wheelhouse)."""
    from composer_jax.env.sandbox.pyenv import EnvCache, default_cache_dir

    if args.wheelhouse is not None and args.index_url is not None:
        raise UsageError("give --wheelhouse or --index-url, not both")
    allow = tuple(proxy_allow(a) for a in args.index_proxy_allow)
    try:
        return EnvCache(
            args.env_cache or default_cache_dir(),
            sandbox,
            wheelhouse=args.wheelhouse,
            index_url=args.index_url,
            proxy_allow=allow,
        )
    except (ValueError, OSError) as exc:
        raise UsageError(str(exc)) from exc


def proxy_allow(text: str) -> tuple[str, int]:
    """`--index-proxy-allow HOST:PORT` as (host, port): a DNS name or an IP address (IPv6 in brackets)."""
    import ipaddress
    import re

    host, sep, port = text.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if bracketed else host
    try:
        ipaddress.ip_address(host)
        named = True
    except ValueError:
        named = (
            not bracketed
            and re.fullmatch(
                r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*", host
            )
            is not None
        )
    number = int(port) if sep and port.isdigit() else -1
    if not named or not 0 < number < 65536:
        raise UsageError(
            f"--index-proxy-allow {text!r}: expected HOST:PORT, a host name or IP address and a port "
            "(files.example.com:443, 10.0.0.5:8443, [2001:db8::1]:443)"
        )
    return host.lower(), number


def source_problem_lines(problems: dict[str, int]) -> list[str]:
    """The summary lines of what kept a run's builds from their packages (`EnvCache.source_problems`:
    a proxy refusal, an untrusted certificate), each naming the flag or setting that changes it."""
    return [f"  package sources: {n} build(s): {why}" for why, n in sorted(problems.items(), key=lambda kv: -kv[1])]
