"""The API key in front of every route of a local vLLM replica but `GET /health`.

vLLM's own key check (`--api-key`, or `VLLM_API_KEY`: vllm/entrypoints/serve/middleware/
authenticate.py) guards only the paths under `/v1`, `/v2`, `/inference` and `/cohere`. The dev-mode
routes a learner's replica serves (VLLM_SERVER_DEV_MODE=1) sit at the root - `/update_weights`,
`/pause`, `/init_weight_transfer_engine`, `/update_weight_version`, `/collective_rpc`, `/sleep` ... -
and vLLM lets any local process call them: one could swap the weights the run samples from. This
ASGI middleware answers 401 to every request that lacks `Authorization: Bearer $VLLM_API_KEY` (a
WebSocket is closed before it is accepted: 403), except `GET /health`, the supervisor's probe; with
no key set it refuses to start, so a replica is never open by mistake.

`composer-jax vllm-replica` (rl/samplers/vllm_child.py) starts vLLM with this module's directory on
its PYTHONPATH and `--middleware replica_auth.ReplicaAuth` (vLLM adds a class given there with
`app.add_middleware`), and the key in the environment, never on the command line. It runs in
vLLM's virtualenv: the standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

KEY_ENV = "VLLM_API_KEY"
OPEN = frozenset({("GET", "/health"), ("HEAD", "/health")})
_REFUSED = b'{"error": "Unauthorized: send Authorization: Bearer <the replica\'s API key>"}'


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ReplicaAuth:
    """`app` behind the replica's API key (module docstring); `key`: `$VLLM_API_KEY` when None."""

    def __init__(self, app: ASGIApp, key: str | None = None):
        key = os.environ.get(KEY_ENV, "") if key is None else key
        if not key:
            raise RuntimeError(f"replica_auth: {KEY_ENV} is empty; a composer-jax vLLM replica serves only with a key")
        self.app, self._key = app, _digest(key)

    def admits(self, scope: Scope) -> bool:
        """Whether the request of `scope` may reach vLLM: the open probe, or the right bearer key."""
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if scope["type"] == "http" and (scope["method"], path) in OPEN:
            return True
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = given.decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(_digest(token.strip()), self._key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.admits(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(_REFUSED)).encode()),
                (b"www-authenticate", b"Bearer"),
            ]
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": _REFUSED})
