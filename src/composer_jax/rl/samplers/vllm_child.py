"""`composer-jax vllm-replica`: one vLLM server as a child of the learner's launcher (runtime/local.py).

    composer-jax vllm-replica --python .venv/vllm/bin/python --port 0 --version 3 -- --model DIR ...

vLLM runs in its own virtualenv (its pins differ from the project's: transformers, mcp, fastapi), so
the launcher cannot start it as a `composer-jax` subcommand itself; this small process (no JAX) is
that subcommand. It

1. starts `PYTHON -m vllm.entrypoints.openai.api_server ARGS --middleware replica_auth.ReplicaAuth
   --host 127.0.0.1 --port PORT` (port 0: a free one, picked here) with `VLLM_SERVER_DEV_MODE=1`
   (the weight-version and weight-transfer routes are dev-mode routes), asking the kernel for
   SIGTERM when this process dies. The replica answers only to the API key in this process's
   `VLLM_API_KEY` (the launcher generates one per run and gives it to the policies; it is passed in
   the environment, never on a command line `ps` shows): vLLM's own key check covers only its
   `/v1`, `/inference` ... paths, so `vllm_site/replica_auth.py` (on vLLM's PYTHONPATH) guards
   every route but `/health`, the dev-mode weight routes included;
2. waits until vLLM answers `/health` (or exits: this process then exits with its status);
3. labels the weights `--version` (`POST /update_weight_version`: vLLM tags every token with the
   label of the weights that sampled it, `weight_versions` spans; its own default is "default");
4. sends one 2-token request (vLLM's first request on CPU takes tens of seconds of one-time set-up,
   which must not count against a rollout);
5. prints the launcher's ready line, then waits; SIGTERM or SIGINT is passed on to vLLM.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

from composer_jax.errors import UsageError
from composer_jax.runtime.placement import ready_line

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
KEY_ENV = "VLLM_API_KEY"  # the replica's API key: vLLM's own variable, read by replica_auth too
SITE_DIR = Path(__file__).resolve().with_name("vllm_site")  # on vLLM's PYTHONPATH (vllm_site/__init__.py)
AUTH_MIDDLEWARE = "replica_auth.ReplicaAuth"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _death_signal() -> None:  # in the child, before exec: this process is single-threaded
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def vllm_command(python: str, vllm_args: list[str], host: str, port: int) -> list[str]:
    """vLLM's command line: its arguments, the key check in front of every route, the address."""
    return [python, "-m", VLLM_MODULE, *vllm_args, "--middleware", AUTH_MIDDLEWARE, "--host", host, "--port", str(port)]


def vllm_env(environ: Mapping[str, str]) -> dict[str, str]:
    """vLLM's environment: `environ` (which must hold the API key), dev mode, `SITE_DIR` on the path."""
    if not environ.get(KEY_ENV):
        raise UsageError(
            f"{KEY_ENV} is not set: a vLLM replica answers only to an API key, given in the environment "
            "(the launcher generates one per run; by hand: export VLLM_API_KEY=... and send it as the bearer token)"
        )
    path = os.pathsep.join(p for p in (str(SITE_DIR), environ.get("PYTHONPATH", "")) if p)
    return {**environ, "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": path}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="composer-jax vllm-replica", description=__doc__.split("\n")[0])
    p.add_argument("--python", required=True, help="the interpreter of vLLM's virtualenv")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--version", type=int, required=True, help="the policy version of the weights it serves")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds for vLLM to answer /health")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then vLLM's own arguments (--model DIR ...)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    rest = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    if not os.access(args.python, os.X_OK):
        raise UsageError(
            f"--python {args.python!r} is not an executable; vLLM's virtualenv is built by "
            "`make venv` (.venv/vllm), or give rl.vllm.python"
        )
    env = vllm_env(os.environ)
    port = args.port or free_port(args.host)
    url = f"http://{args.host}:{port}"
    cmd = vllm_command(args.python, rest, args.host, port)
    print("vllm-replica: " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_death_signal)

    def forward(signum: int, _frame: object) -> None:
        proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    deadline = time.monotonic() + args.start_timeout
    with httpx.Client(timeout=600.0, headers={"Authorization": f"Bearer {env[KEY_ENV]}"}) as http:
        while True:
            if (rc := proc.poll()) is not None:
                print(f"vllm-replica: vLLM exited with status {rc} before answering /health", file=sys.stderr)
                return rc or 1
            try:
                if http.get(url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                proc.terminate()
                proc.wait()
                print(
                    f"vllm-replica: vLLM did not answer {url}/health within {args.start_timeout:g} s", file=sys.stderr
                )
                return 1
            time.sleep(0.5)
        try:
            http.post(url + "/update_weight_version", json={"new_version": str(args.version)}).raise_for_status()
            warm = {"token_ids": [0], "sampling_params": {"max_tokens": 2, "temperature": 0.0, "detokenize": False}}
            http.post(url + "/inference/v1/generate", json=warm).raise_for_status()
        except httpx.HTTPError as e:
            proc.terminate()
            proc.wait()
            print(f"vllm-replica: setting up {url} failed: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    print(ready_line(url), flush=True)
    return proc.wait()
