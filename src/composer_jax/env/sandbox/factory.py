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
    """--env-cache, --wheelhouse, --index-url: where tasks' Python environments (pyenv.py) are built from and kept."""
    p.add_argument(
        "--env-cache",
        type=Path,
        default=None,
        help="directory of built task Python environments (default ~/.cache/composer_jax/envs)",
    )
    p.add_argument("--wheelhouse", type=Path, help="build environments offline from this directory of wheels/sdists")
    p.add_argument("--index-url", help="build environments from this package index (the build gets network)")
    p.add_argument(
        "--index-proxy-allow",
        action="append",
        default=[],
        metavar="ADDRESS:PORT",
        help="let builds reach the index's hosts at this non-public address too (a machine whose way out is a "
        "proxy at a private or reserved address; index_proxy.py refuses those otherwise); repeatable",
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
    """`--index-proxy-allow ADDRESS:PORT` as (address, port): an IP address (IPv6 in brackets), not a name
    (the proxy compares the addresses a host resolves to)."""
    import ipaddress

    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
        number = int(port) if sep else -1
    except ValueError:
        number = -1
    if not 0 < number < 65536:
        raise UsageError(
            f"--index-proxy-allow {text!r}: expected ADDRESS:PORT, an IP address and a port (203.0.113.80:443)"
        )
    return host, number
