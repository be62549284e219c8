"""Command lines: `composer-jax env-server ...` and `composer-jax env validate DIR ...`.

Both are wired in composer_jax/cli.py and import nothing from JAX.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import secrets
import socket
import sys
from pathlib import Path

from composer_jax.env.sandbox.factory import add_env_cache_flags, make_env_cache, make_sandbox
from composer_jax.env.tasks.task_env import build_envs
from composer_jax.errors import UsageError
from composer_jax.flags import int_at_least

_positive_int = int_at_least(0, strict=True)
_non_negative_int = int_at_least(0)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535; 0 picks a free port)") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is outside 0-65535 (0 picks a free port)")
    return value


def server_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="composer-jax env-server",
        description="Serve sandboxed coding workspaces over HTTP/JSON (+ OpenEnv WebSocket).",
    )
    p.add_argument("--tasks", type=Path, required=True, help="directory of Harbor-layout tasks")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1, loopback only)")
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a name clients reach the server by, besides its bound address (and localhost on loopback); "
        "/mcp refuses a Host or Origin naming any other (DNS rebinding); repeatable",
    )
    p.add_argument("--port", type=_port, default=0, help="port (default 0: a free port, printed at start)")
    p.add_argument("--token", help="bearer token (default: generated and printed once); or COMPOSER_JAX_ENV_TOKEN")
    p.add_argument("--token-file", type=Path, help="read the bearer token from this file")
    p.add_argument("--max-sessions", type=_positive_int, default=256, help="concurrent sessions (then 429)")
    p.add_argument("--session-ttl", type=float, default=1800.0, help="idle seconds before a session is closed")
    p.add_argument("--shell-timeout", type=float, default=120.0, help="upper bound on run_shell timeout_s")
    p.add_argument("--max-body-bytes", type=_positive_int, default=4 * 2**20, help="request size limit")
    p.add_argument("--work-dir", type=Path, help="where session workspaces live (default: a new temp dir)")
    p.add_argument(
        "--grade-cache",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="answer a grade of a change equal to one graded before (same task, same carried files, paths, modes "
        "and bytes) with that grade's verdict, keeping the last N verdicts the tests gave; 0: off (default)",
    )
    p.add_argument(
        "--unsafe-no-sandbox",
        action="store_true",
        help="allow running without bubblewrap: commands run as plain host processes (NO isolation)",
    )
    p.add_argument(
        "--web-search",
        default="offline",
        metavar="offline|searxng:URL|off",
        help="web_search/read_page backend: the offline documentation index (default), a SearXNG API, or off",
    )
    p.add_argument(
        "--web-search-offer",
        default="tasks",
        choices=["tasks", "all"],
        help="which sessions get the web tools: tasks whose task.toml sets [agent] web_search = true (default), or all",
    )
    p.add_argument("--docs-dir", type=Path, help="also index these pages (.html .md .rst .txt) offline")
    p.add_argument(
        "--docs-packages",
        nargs="+",
        metavar="DIST",
        help="installed distributions the offline index covers (default: all in the server's environment)",
    )
    p.add_argument(
        "--web-fetch-private",
        action="store_true",
        help="let read_page fetch private, loopback and link-local hosts (refused by default)",
    )
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    add_env_cache_flags(p)
    return p


def _make_web_tools(args: argparse.Namespace):
    """The server's web tools from its flags: WebTools, or None (`--web-search off`). The offline
    index is built (or loaded from its cache) in a background thread when the first session is
    offered the tools (`Backend.prepare`)."""
    from composer_jax.env.tools.web_search import make_web_tools

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "composer-jax" / "doc-index"
    try:
        return make_web_tools(
            args.web_search,
            offer=args.web_search_offer,
            docs_dir=args.docs_dir,
            packages=args.docs_packages,
            cache_dir=cache,
            fetch_private=args.web_fetch_private,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def _server_token(args: argparse.Namespace) -> tuple[str, bool]:
    """The bearer token (--token, $COMPOSER_JAX_ENV_TOKEN, --token-file, else a fresh one) and whether
    it was generated here. Only a generated token is ever printed: one given to the server is the
    caller's secret, and the startup line lands in logs (runtime/local.py keeps a child's stdout)."""
    token = args.token or os.environ.get("COMPOSER_JAX_ENV_TOKEN")
    if args.token_file:
        try:
            token = args.token_file.read_text().strip()
        except OSError as exc:
            raise UsageError(f"--token-file {args.token_file}: {exc.strerror}") from exc
    if token is not None and len(token) < 16:
        raise UsageError("the token must be at least 16 characters")
    return (token, False) if token else (_fresh_token(), True)


def _fresh_token() -> str:
    """A generated token (urlsafe base64, 43 characters) that never starts with "-", so that it
    can be passed back as `--token TOKEN` (argparse reads a leading "-" as an option: 1 in 64 did)."""
    while True:
        token = secrets.token_urlsafe(32)
        if not token.startswith("-"):
            return token


def _task_store(tasks: Path, work_dir: Path | None):
    """The served tasks, warning on stderr about each task directory that cannot be read."""
    from composer_jax.env.api.errors import TaskError
    from composer_jax.env.tasks.store import TaskStore

    try:
        store = TaskStore(tasks, (work_dir or Path(os.environ.get("TMPDIR", "/tmp"))) / "composer-jax-task-cache")
    except TaskError as exc:
        raise UsageError(str(exc)) from exc
    _warn_skipped(store)
    return store


def _warn_skipped(store) -> None:
    for name, err in store.errors.items():
        print(f"warning: skipping task directory {name}: {err}", file=sys.stderr)


def _session_manager(args: argparse.Namespace, store, sandbox, env_cache, web_tools):
    """The sessions' owner, as the flags size it."""
    from composer_jax.env.sandbox.runner import Limits
    from composer_jax.env.server.session import SessionManager
    from composer_jax.env.tasks.grader import GradeCache

    try:
        return SessionManager(
            store,
            sandbox,
            work_dir=args.work_dir,
            max_sessions=args.max_sessions,
            default_ttl_s=args.session_ttl,
            limits=Limits(wall_seconds=args.shell_timeout),
            env_cache=env_cache,
            web_tools=web_tools,
            grade_cache=GradeCache(args.grade_cache) if args.grade_cache else None,
        )
    except (RuntimeError, OSError) as exc:  # e.g. --work-dir held by another live server
        raise UsageError(str(exc)) from exc


def _listen(host: str, port: int) -> tuple[socket.socket, str]:
    """A listening socket on host:port and the server's URL on it."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        family = socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit TCP_NODELAY from the listening socket. Without it, Nagle's
    # algorithm plus the client's delayed ACK adds ~40 ms to every keep-alive request.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot bind {host}:{port}: {exc.strerror}") from exc
    sock.listen(1024)
    bound_host, bound_port = sock.getsockname()[:2]
    return sock, f"http://{bound_host if family == socket.AF_INET else f'[{bound_host}]'}:{bound_port}"


def _serve(manager, token: str, sock: socket.socket, url: str, args: argparse.Namespace) -> None:
    """Serve the sessions' HTTP app with uvicorn on the bound socket until stopped, printing the
    ready line once it serves."""
    import uvicorn

    from composer_jax.env.server.app import create_app
    from composer_jax.env.server.mcp_http import HostPolicy

    # the names /mcp answers to: the bound address, --host when it is a name, each --allowed-host
    hosts = HostPolicy.for_bind(sock.getsockname()[0], [args.host, *args.allowed_host])

    # httptools (when installed; else h11) parses requests several times faster than h11. The
    # stdlib event loop, not uvloop: libuv spawns with fork() where CPython uses vfork(), and with
    # uvloop run_shell (one bwrap per call) ran at ~75 instead of ~105 calls/s on 2 cores.
    config = uvicorn.Config(
        create_app(manager, token, max_body_bytes=args.max_body_bytes, hosts=hosts),
        log_level=args.log_level,
        ws_max_size=args.max_body_bytes,
        timeout_graceful_shutdown=5,
        limit_concurrency=4096,
        backlog=1024,
        loop="asyncio",
        http="auto",
        access_log=False,
    )

    class ReadyServer(uvicorn.Server):
        # once uvicorn serves: the ready line a run's launcher waits for (runtime/local.py)
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                print(json.dumps({"event": "ready", "url": url, "pid": os.getpid()}), flush=True)

    ReadyServer(config).run(sockets=[sock])


def env_server_main(argv: list[str]) -> int:
    """`composer-jax env-server`: serves until stopped, then returns 0."""
    args = server_parser().parse_args(argv)
    token, generated = _server_token(args)
    sandbox = make_sandbox(args.unsafe_no_sandbox, args.shell_timeout)
    web_tools = _make_web_tools(args)
    store = _task_store(args.tasks, args.work_dir)
    env_cache = make_env_cache(args, sandbox)
    # Every task's Python environment is built now, never inside a session's step; a task whose
    # build fails is served, and its sessions are refused with the build's error.
    build_envs(env_cache, store.tasks())
    manager = _session_manager(args, store, sandbox, env_cache, web_tools)
    sock, url = _listen(args.host, args.port)
    if not sandbox.isolated:
        print("WARNING: --unsafe-no-sandbox: commands run as plain host processes with NO isolation", file=sys.stderr)
    shown = f" token={token}" if generated else ""  # a given token is never echoed
    tasks = len(store.ids())
    print(f"composer-jax env-server listening on {url} tasks={tasks} sandbox={sandbox.name}{shown}", flush=True)
    _serve(manager, token, sock, url, args)
    return 0


def validate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="composer-jax env validate",
        description="Check that every task's reference solution scores 1 and its untouched workspace scores 0.",
    )
    p.add_argument("dir", type=Path, help="directory of Harbor-layout tasks")
    p.add_argument("--jobs", type=_positive_int, default=2, help="tasks validated in parallel (default 2)")
    p.add_argument(
        "--families", nargs="*", default=None, help="also validate these generated families (no names: all of them)"
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds for generated families")
    p.add_argument("--strict", action="store_true", help="count tasks that cannot run locally as failures")
    p.add_argument("--unsafe-no-sandbox", action="store_true", help="run without bubblewrap (NO isolation)")
    add_env_cache_flags(p)
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="composer-jax env build",
        description="Pre-build the Python environment of every task that declares one ([environment] python, "
        "requirements, install_app) into the env cache; prints one line per task (key, build time).",
    )
    p.add_argument("dir", type=Path, help="directory of Harbor-layout tasks")
    add_env_cache_flags(p)
    return p


def _require_dir(path: Path) -> None:
    if not path.is_dir():
        raise UsageError(f"{path} is not a directory")


def build_main(argv: list[str]) -> int:
    import tempfile

    from composer_jax.env.tasks.store import TaskStore

    args = build_parser().parse_args(argv)
    _require_dir(args.dir)
    cache = make_env_cache(args, make_sandbox(False, 600))
    store = TaskStore(args.dir, Path(tempfile.mkdtemp(prefix="composer-jax-build-cache-")))
    _warn_skipped(store)
    failures = build_envs(cache, store.tasks(), out=sys.stdout)
    return 1 if failures else 0


def generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="composer-jax env generate",
        description="Write tasks of a generated family as Harbor task directories OUT/<family>-<seed>/ "
        "(e.g. for `composer-jax data make-sft --tasks OUT`).",
    )
    p.add_argument("family", help="a family of env/task_families, e.g. set-constant")
    p.add_argument("--seeds", default="8", help="N (seeds 0..N-1) or A:B (seeds A..B-1); default 8")
    p.add_argument("--out", type=Path, required=True, help="parent directory of the task directories")
    return p


def generate_main(argv: list[str]) -> int:
    from composer_jax.env.tasks.families import FAMILIES, generate_task

    args = generate_parser().parse_args(argv)
    try:
        lo, hi = (int(x) for x in args.seeds.split(":")) if ":" in args.seeds else (0, int(args.seeds))
    except ValueError:
        lo, hi = -1, -1
    if lo < 0 or hi <= lo:
        raise UsageError(f"--seeds {args.seeds!r}: expected N (seeds 0..N-1) or A:B with 0 <= A < B")
    if args.family not in FAMILIES:
        raise UsageError(f"unknown family {args.family!r}; accepted: {', '.join(sorted(FAMILIES))}")
    for seed in range(lo, hi):
        generate_task(args.family, seed, args.out)
    print(f"wrote {hi - lo} {args.family} tasks (seeds {lo}..{hi - 1}) under {args.out}")
    return 0


def validate_main(argv: list[str]) -> int:
    """`composer-jax env validate`: 0 when every task passes, else 1."""
    import tempfile

    from composer_jax.env.tasks.store import TaskStore
    from composer_jax.env.tasks.validate import format_report, validate_all

    args = validate_parser().parse_args(argv)
    _require_dir(args.dir)
    sandbox = make_sandbox(args.unsafe_no_sandbox, 600)
    store = TaskStore(args.dir, Path(tempfile.mkdtemp(prefix="composer-jax-validate-cache-")))
    families = [] if args.families is None else (args.families or store.families())
    unknown = sorted(set(families) - set(store.families()))
    if unknown:
        raise UsageError(f"unknown families {unknown}; accepted: {store.families()}")

    def progress(r):
        print(f"  {r.status:<7} {r.task_id} {r.detail}", file=sys.stderr, flush=True)

    env_cache = make_env_cache(args, sandbox)
    reports = asyncio.run(
        validate_all(
            store,
            sandbox,
            jobs=args.jobs,
            families=families,
            seeds=args.seeds,
            progress=progress,
            env_cache=env_cache,
        )
    )
    print(format_report(reports))
    bad = {"fail", "invalid"} | ({"skipped"} if args.strict else set())
    if not reports:
        print(f"composer-jax env validate: no tasks found in {args.dir}", file=sys.stderr)
        return 1
    return 1 if any(r.status in bad for r in reports) else 0


_ENV_USAGE = (
    "usage: composer-jax env validate DIR [--jobs N] [--families [F ...]] [--seeds S ...] [--strict]\n"
    "       composer-jax env generate FAMILY [--seeds N|A:B] --out DIR\n"
    "       composer-jax env mine REPO --out DIR [--rev-range R] [--since D] [--until D] [--max-tasks N] ...\n"
    "       composer-jax env import-swebench INSTANCES.jsonl --repos DIR --out DIR\n"
    "       composer-jax env build DIR [--env-cache DIR] [--wheelhouse DIR | --index-url URL]\n"
    "       composer-jax env upgrade-verifier DIR [DIR ...]"
)


def env_main(argv: list[str]) -> int:
    """`composer-jax env SUBCOMMAND`: validate, generate, build, mine, import-swebench or upgrade-verifier."""
    if not argv or argv[0] in ("-h", "--help"):
        print(_ENV_USAGE)
        return 0 if argv else 2
    if argv[0] in ("mine", "import-swebench"):
        from composer_jax.env.mining.cli import env_subcommand

        return env_subcommand(argv)
    from composer_jax.env.tasks.upgrade import upgrade_main

    subcommands = {"validate": validate_main, "generate": generate_main, "build": build_main}
    subcommands["upgrade-verifier"] = upgrade_main
    if argv[0] not in subcommands:
        raise UsageError(
            f"unknown subcommand {argv[0]!r}; accepted: validate, generate, build, mine, import-swebench, "
            "upgrade-verifier"
        )
    return subcommands[argv[0]](argv[1:])
