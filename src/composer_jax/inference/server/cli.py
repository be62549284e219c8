"""`composer-jax serve` (the OpenAI-compatible server) and `composer-jax sample` (one prompt, printed).

    composer-jax serve --checkpoint runs/tiny/stage3_sft/checkpoints [--port 8000] [--api-key KEY]
        [--weights-from file:///runs/rl/weights --poll-interval 1]
    composer-jax sample --checkpoint DIR --prompt "def add(a, b):" [--chat] [--max-tokens 64] [--json]
        [--return-token-ids]

--checkpoint takes a training run's checkpoint directory (its latest step, or --step), one step's
directory, a `convert --to-orbax` directory or a Hugging Face directory (hf/checkpoint_kind.py).
The tokenizer is --tokenizer, else a tokenizer.json next to the checkpoint, else the training
run's data.tokenizer (resolved against the current directory, as in training).
--weights-from follows an RL weight-sync store by URL: each newer published version is swapped in
between two decode steps and served under its published version number (docs/inference.md).
--speculative-tokens K (both commands) decodes with K MTP drafts per step; --draft-experts N and
--draft-vocab FILE make the drafts cheaper (the Sampler's draft_experts and draft_vocab).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

from composer_jax.config.sampler import SERVE_SAMPLER, SamplerConfig, add_sampler_flags, sampler_from_args
from composer_jax.errors import ConfigError, UsageError
from composer_jax.flags import int_at_least

API_KEY_ENV = "COMPOSER_JAX_API_KEY"


_positive_int = int_at_least(1)
_non_negative_int = int_at_least(0)


def user_errors() -> tuple[type[Exception], ...]:
    """The exceptions that are the user's fault, raised where the fault is found: a value of a flag or
    setting (ConfigError: the sampler's and speculative decoding's checks among them), a checkpoint
    directory (CheckpointError), a weight-sync store (WeightSyncError). `serve` and `sample` turn
    these, and only these, into a UsageError (exit 2, one line); anything else, a ValueError from
    deep inside included, is a bug and keeps its traceback."""
    from composer_jax.checkpoint.validate import CheckpointError
    from composer_jax.weightsync.store import WeightSyncError

    return (ConfigError, CheckpointError, WeightSyncError)


def _mesh_arg(text: str) -> dict[str, int]:
    from composer_jax.config import MESH_AXES

    out: dict[str, int] = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key not in MESH_AXES or not value.lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(
                f"{part!r} is not accepted; accepted: comma-separated AXIS=SIZE with AXIS in {MESH_AXES}, "
                "e.g. tensor=2,expert=4"
            )
        out[key] = int(value)
    return out


def _token_ids_file(text: str) -> list[int]:
    """--draft-vocab: a file of token ids (a JSON list, or integers separated by spaces, commas or lines)."""
    try:
        raw = Path(text).read_text()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {e.strerror}") from None
    try:
        items = json.loads(raw) if raw.lstrip().startswith("[") else raw.replace(",", " ").split()
        ids = [int(t) for t in items]
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of token ids; accepted: a JSON list of integers or integers separated by "
            "spaces, commas or newlines"
        ) from None
    if not ids or min(ids) < 0:
        bad = "no ids" if not ids else f"negative id {min(ids)}"
        raise argparse.ArgumentTypeError(f"{text!r} holds {bad}; give at least one token id, all >= 0")
    return ids


def _speculative_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative-tokens",
        type=_non_negative_int,
        default=0,
        help="MTP speculative decoding: tokens drafted per step (default 0: off; needs a model with MTP modules)",
    )
    p.add_argument(
        "--draft-experts",
        type=_non_negative_int,
        default=None,
        help="routed experts per token in the drafts' MTP block, 0..the model's experts per token (0: its "
        "shared expert only); cheaper drafts, same output distribution (default: the model's own)",
    )
    p.add_argument(
        "--draft-vocab",
        type=_token_ids_file,
        default=None,
        metavar="FILE",
        help="draft only over these token ids (a file: JSON list or whitespace/comma-separated integers, e.g. "
        "the most frequent tokens of the training data); default: the whole vocabulary",
    )


def speculative_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The speculative `SamplerSettings` fields from parsed --speculative-tokens / --draft-experts /
    --draft-vocab; exits through p.error (status 2) when a draft option is given without drafting.
    Ranges that depend on the model (draft experts, vocabulary size) are checked by the Sampler."""
    k = args.speculative_tokens
    for flag, value in (("--draft-experts", args.draft_experts), ("--draft-vocab", args.draft_vocab)):
        if value is not None and k < 1:
            p.error(f"{flag} needs --speculative-tokens >= 1 (got {k}); it only shapes the drafts")
    return {"speculative_tokens": k, "draft_experts": args.draft_experts, "draft_vocab": args.draft_vocab}


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (see module help)")
    p.add_argument("--step", type=int, default=None, help="training checkpoints: the step (default: the latest)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json or its directory (default: see module help)")
    p.add_argument(
        "--max-len", type=_positive_int, default=None, help="context per request (default: min(4096, model))"
    )
    p.add_argument(
        "--mesh", type=_mesh_arg, default=None, help="device mesh, e.g. tensor=2,expert=4 (default: one device)"
    )


def _load(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """-> (policy, tokenizer, mesh, max_len); raises ConfigError / CheckpointError with the cause."""
    from composer_jax.config import MeshConfig
    from composer_jax.formats.tokenizer import load_tokenizer
    from composer_jax.inference.server.policy import load_policy
    from composer_jax.sharding import make_mesh

    mesh = None
    if args.mesh:
        mesh = make_mesh(MeshConfig(**{"fsdp": 1, **args.mesh}))
    policy = load_policy(args.checkpoint, step=args.step, mesh=mesh, key="--checkpoint")
    where = args.tokenizer or policy.tokenizer_hint
    if where is None:
        raise ConfigError(
            f"no tokenizer found for {args.checkpoint!r} (no tokenizer.json next to it, no data.tokenizer in its "
            "run config); pass --tokenizer PATH"
        )
    tok = load_tokenizer(where)
    cfg = policy.cfg
    if tok.vocab_size > cfg.vocab_size:
        raise ConfigError(
            f"the tokenizer {where!r} has {tok.vocab_size} tokens but the model's vocab_size is {cfg.vocab_size}; "
            "pass the tokenizer the model was trained with (--tokenizer)"
        )
    # speculative decoding keeps 2 x k positions past a request's context for the chained drafts
    reserve = 2 * args.speculative_tokens
    limit = cfg.max_position_embeddings - reserve
    max_len = args.max_len or min(4096, limit)
    if max_len > limit:
        raise ConfigError(
            f"--max-len {max_len} exceeds the model's max_position_embeddings={cfg.max_position_embeddings}"
            + (f" less 2 x --speculative-tokens {args.speculative_tokens}" if reserve else "")
            + f"; accepted: at most {limit}"
        )
    return policy, tok, mesh, max_len


def _new_sampler(
    policy: Any, tok: Any, mesh: Any, sampler: SamplerConfig, max_len: int, speculative: dict[str, Any] | None = None
):
    """-> (params, version) -> Sampler with `sampler`'s settings (`Sampler.from_config`: warmed up
    when it says so); speculative: `speculative_options`' keyword arguments."""
    from composer_jax.inference.engine.batch_sampler import Sampler

    detok = lambda ids: tok.decode(ids, skip_special_tokens=True)

    def new(params: Any, version: int) -> Sampler:
        return Sampler.from_config(
            params,
            policy.cfg,
            sampler,
            max_len=max_len,
            version=version,
            mesh=mesh,
            detokenize=detok,
            **(speculative or {}),
        )

    return new


# ---------------------------------------------------------------------------- serve
def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="composer-jax serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _model_args(p)
    _speculative_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: a free port, printed at start)")
    p.add_argument("--api-key", default=None, help=f"bearer key (or set {API_KEY_ENV}; default: generated and printed)")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the checkpoint's name)")
    add_sampler_flags(p)
    p.add_argument("--version", type=int, default=0, help="policy version of the loaded weights (default 0)")
    p.add_argument(
        "--weights-from", default=None, help="weight-sync store URL to follow (file://DIR, gs://..., s3://...)"
    )
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    return p


def default_model_name(policy: Any) -> str:
    name = getattr(policy.cfg, "name", "") or ""
    path = Path(policy.path).resolve()
    base = path.parent.name if path.name == "checkpoints" or path.name.isdigit() else path.name
    return name if name and name != "model" else base or "composer-jax"


def _api_key(args: argparse.Namespace) -> tuple[str, bool]:
    """The bearer key (--api-key, else $COMPOSER_JAX_API_KEY, else a fresh one) and whether it was generated."""
    import secrets

    key = args.api_key or os.environ.get(API_KEY_ENV)
    if key is not None and len(key) < 16:
        raise UsageError("the API key must be at least 16 characters")
    return key or secrets.token_urlsafe(32), key is None


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, for uvicorn to listen on."""
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise UsageError(f"cannot bind {host}:{port}: {e.strerror}") from e
    return sock


def serve_main(argv: list[str] | None = None) -> int:
    parser = _serve_parser()
    args = parser.parse_args(argv)
    speculative = speculative_options(parser, args)
    logging.basicConfig(level=args.log_level.upper())
    key, generated = _api_key(args)
    if not args.poll_s > 0:
        raise UsageError(f"--poll-interval {args.poll_s} must be > 0 (seconds)")
    sampler = sampler_from_args(args)
    try:
        policy, tok, mesh, max_len = _load(args)
    except user_errors() as e:
        raise UsageError(str(e)) from e
    sock = _bind(args.host, args.port)
    one_at_a_time = mesh is not None or args.speculative_tokens > 0
    if args.warm_up and one_at_a_time:
        print(
            "composer-jax serve: --warm-up skipped: a --mesh or --speculative-tokens sampler admits one prompt at a "
            "time and compiles at first use",
            file=sys.stderr,
        )
    try:
        server, engine = build_server(
            policy,
            tok,
            mesh=mesh,
            sampler=sampler,
            max_len=max_len,
            api_key=key,
            model_name=args.model_name or default_model_name(policy),
            version=args.version,
            weights_from=args.weights_from,
            speculative=speculative,
        )
    except user_errors() as e:
        sock.close()
        raise UsageError(str(e)) from e
    except BaseException:
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    print(
        f"composer-jax serve: {server.model_name} ({policy.kind} checkpoint {policy.path}"
        f"{f', step {policy.step}' if policy.step is not None else ''}) on {url}/v1 "
        f"slots={sampler.slots} max_len={max_len}"
        + (f" following {args.weights_from}" if args.weights_from else "")
        + (f" api_key={key}" if generated else ""),
        flush=True,
    )
    if host not in ("127.0.0.1", "::1", "localhost"):
        print(f"composer-jax serve: WARNING: listening on {host}, reachable from other machines", file=sys.stderr)
    from composer_jax.formats.chat_format import chat_format

    if (why := chat_format(tok).unavailable()) is not None:
        print(f"composer-jax serve: NOTE: {why}", file=sys.stderr)
    run_uvicorn(server.app, sock, args.log_level, ready_url=url)
    engine.stop()
    return 0


def build_server(
    policy: Any,
    tok: Any,
    *,
    mesh: Any = None,
    sampler: SamplerConfig = SERVE_SAMPLER,
    max_len: int,
    api_key: str,
    model_name: str,
    version: int = 0,
    weights_from: str | None = None,
    speculative: dict[str, Any] | None = None,
):
    """-> (OpenAIServer, started Engine) over a loaded policy; the admin endpoint loads on `mesh`.
    sampler: the sampler's settings (slots, queue bound, prefix cache, warm-up; config/sampler.py);
    weights_from: a weight-sync store URL the server follows (polled every sampler.poll_s);
    speculative: the Sampler's speculative_tokens / draft_experts / draft_vocab (`speculative_options`)."""
    from composer_jax.inference.engine.thread_engine import Engine
    from composer_jax.inference.server.app import OpenAIServer
    from composer_jax.inference.server.policy import load_policy

    engine = Engine(
        _new_sampler(policy, tok, mesh, sampler, max_len, speculative),
        policy.params,
        version,
        max_queued=sampler.max_queued,
    )
    engine.start()
    try:
        server = OpenAIServer(
            engine,
            tok,
            model_name=model_name,
            api_key=api_key,
            load_policy=lambda path, step: load_policy(path, step=step, mesh=mesh),
            weights_from=weights_from,
            poll_interval_s=sampler.poll_s,
            lora=policy.lora,
        )
    except BaseException:
        engine.stop()
        raise
    return server, engine


def run_uvicorn(app: Any, sock: socket.socket, log_level: str = "warning", ready_url: str | None = None) -> None:
    """Serve `app` on `sock`; with `ready_url`, print the ready line `{"event": "ready", "url": ...,
    "pid": ...}` once uvicorn serves (what a run's launcher waits for: runtime/local.py)."""
    import uvicorn

    class ReadyServer(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started and ready_url is not None:
                print(json.dumps({"event": "ready", "url": ready_url, "pid": os.getpid()}), flush=True)

    # keep-alive well past a client's pauses between turns (uvicorn's 5 s default closes pooled
    # connections the learner is about to reuse)
    config = uvicorn.Config(
        app, log_level=log_level, access_log=False, timeout_graceful_shutdown=5, timeout_keep_alive=75
    )
    ReadyServer(config).run(sockets=[sock])


# ---------------------------------------------------------------------------- sample
def _sample_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="composer-jax sample",
        description="Sample one completion from a checkpoint and print it (no server).",
    )
    _model_args(p)
    _speculative_args(p)
    p.add_argument("--prompt", required=True, help="the prompt text ('-' reads standard input)")
    p.add_argument("--chat", action="store_true", help="the prompt is a user message in the chat template")
    p.add_argument("--system", default=None, help="--chat: a system message before it")
    p.add_argument("--tools", type=Path, default=None, help="--chat: a JSON file with an OpenAI tools list")
    p.add_argument("--max-tokens", type=_positive_int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=_positive_int, default=1, help="completions (seeds seed, seed+1, ...)")
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--logprobs", action="store_true", help="print each generated token with its log-probability")
    p.add_argument("--json", action="store_true", help="print the OpenAI-shaped response JSON instead of the text")
    p.add_argument(
        "--return-token-ids",
        action="store_true",
        help="print the prompt's token ids too (with --json: vLLM's prompt_token_ids field), to check a chat "
        "template's rendering",
    )
    return p


def _sample_request(args, prompt: str):
    """The checkpoint `sample` loads and its request parsed as the OpenAI server would parse it."""
    from composer_jax.inference.server import openai_api as api

    body: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "n": args.n,
        "stop": args.stop,
        "return_token_ids": args.return_token_ids,
    }
    try:
        policy, tok, mesh, max_len = _load(args)
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": prompt}
            ]
            body.update(messages=messages, logprobs=True)
            if args.tools is not None:
                body["tools"] = _tools_file(args.tools)
            gen = api.parse_chat(body, tok=tok, served="local", max_len=max_len, vocab=policy.cfg.vocab_size)
        else:
            body.update(prompt=prompt, logprobs=0)
            gen = api.parse_completion(body, tok=tok, served="local", max_len=max_len, vocab=policy.cfg.vocab_size)
    except api.ApiError as e:
        raise UsageError(e.message) from e
    except user_errors() as e:
        raise UsageError(str(e)) from e
    return policy, tok, mesh, max_len, gen


def _tools_file(path: Path) -> Any:
    """--tools: the JSON file's content (the API checks its shape); UsageError when unreadable or not JSON."""
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise UsageError(f"--tools {str(path)!r}: cannot read it: {e.strerror}") from e
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        raise UsageError(f"--tools {str(path)!r}: not a JSON file ({e}); accepted: an OpenAI tools list") from e


def _print_choices(gen, choices: list[dict], done, tok, logprobs: bool) -> None:
    """`sample`'s plain-text output: each choice's text (or message and tool calls), its logprobs."""
    for c, (choice, d) in enumerate(zip(choices, done)):
        if len(choices) > 1:
            print(f"--- choice {c} ({choice['finish_reason']})")
        if gen.kind == "completion":
            print(choice["text"])
        else:
            msg = choice["message"]
            print(msg["content"] or "")
            for call in msg.get("tool_calls", []):
                print(f"[tool call] {call['function']['name']}({call['function']['arguments']})")
            for bad in choice["malformed_tool_calls"]:
                print(f"[malformed tool call] {bad}")
        if logprobs:
            for t, lp in zip(d.tokens, d.logprobs):
                print(f"{t:>7} {lp:>10.4f} {tok.decode([t])!r}")


def sample_main(argv: list[str] | None = None) -> int:
    parser = _sample_parser()
    args = parser.parse_args(argv)
    speculative = speculative_options(parser, args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    from composer_jax.inference.engine.batch_sampler import Request
    from composer_jax.inference.server import openai_api as api

    policy, tok, mesh, max_len, gen = _sample_request(args, prompt)
    try:
        sampler = _new_sampler(policy, tok, mesh, SamplerConfig(slots=min(len(gen.params), 8)), max_len, speculative)(
            policy.params, 0
        )
    except user_errors() as e:  # e.g. a speculative option the model does not accept (no MTP modules, draft experts)
        raise UsageError(str(e)) from e
    reqs = [Request(gen.prompts[c // gen.n], p, id=str(c)) for c, p in enumerate(gen.params)]
    done = sampler.run(reqs)
    choices = [api.completion_choice(gen, c, tok, d, f"call_{c}") for c, d in enumerate(done)]
    if args.json:
        used = api.usage(sum(len(p) for p in gen.prompts), sum(len(d.tokens) for d in done))
        response = {"object": gen.kind, "choices": choices, "usage": used, **api.response_fields(gen)}
        print(json.dumps(response, ensure_ascii=False, indent=1))
    else:
        if args.return_token_ids:
            for ids in gen.prompts:
                print(f"[prompt token ids] {ids}")
        _print_choices(gen, choices, done, tok, args.logprobs)
    return 0
