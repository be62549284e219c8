"""The `serve` replica backend: samplers that are `composer-jax serve` replicas in other processes or
on other hosts (started by the run: rl/samplers/serve_launch.py, or given by URL).

`RemoteTokenPolicy` is the in-process `TokenPolicy` with the sampler behind HTTP: the same chat template,
the same `Generation` records (the model's own tokens verbatim, loss mask, sampler log-probabilities,
per-token policy versions, routed experts of every position), so the learner trains on rollouts from
a fleet of `composer-jax serve` replicas exactly as on the in-process sampler. Each turn is one
`POST /v1/completions` with the whole context as token ids and the extension fields the server
offers: `stop_token_ids` + `ignore_eos` (stop at `<|im_end|>` only, as the token policy does),
`logprobs: 0`, `return_routing` + `return_prompt_routing`; the answer's `token_ids`,
`logprobs.token_logprobs`, `token_versions`, `prompt_routed_experts` and `routed_experts` are recorded.

A replica that cannot serve - connection refused or dropped, a timeout, the engine failed the
request (500), the server shutting down (503), still full after `full_retries` tries (429), a
malformed answer, or this policy closed - raises `SamplerUnavailable`: the rollout in flight is not
scored and the learner redoes it on another sampler. A request the replica refuses (400: e.g. the
context is longer than the replica's) raises ValueError, as `TokenPolicy` does for the in-process
sampler.

`ServeReplicas` is the backend: the learner publishes each version to its weight store
(`rl.weight_store`), and every replica is told to load it from there (`/admin/load_weights`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import numpy as np

from composer_jax.formats.tokenizer import Tokenizer
from composer_jax.rl.samplers.base import ReplicaBackend, Sampled, TokenSampler
from composer_jax.rl.samplers.policy import PolicyPool, SamplerUnavailable, TurnRequest
from composer_jax.runtime.profile import counters_of


def api_root(base_url: str) -> str:
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise ValueError(f"base_url {base_url!r} is not accepted; accepted: http(s)://HOST:PORT (optionally /v1)")
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def answer_json(resp: httpx.Response, where: str) -> dict:
    """A sampler replica's final answer as a JSON object: SamplerUnavailable for one that cannot
    serve (429 after retries, 5xx, not a JSON object), ValueError for a request it refused (4xx)."""
    text = resp.text[:500]
    if resp.status_code in (429, 500, 502, 503, 504):
        raise SamplerUnavailable(f"{where}: HTTP {resp.status_code}: {text}")
    if resp.status_code >= 400:
        raise ValueError(f"{where} refused the request: HTTP {resp.status_code}: {text}")
    try:
        data = resp.json()
    except ValueError as e:
        raise SamplerUnavailable(f"{where}: the answer is not JSON: {text}") from e
    if not isinstance(data, dict):
        raise SamplerUnavailable(f"{where}: the answer is not a JSON object: {text}")
    return data


class RemoteTokenPolicy(TokenSampler):
    """The token policy over a serve replica's `/v1/completions` (module docstring).

    base_url: the replica (`http://host:port` or `.../v1`); api_key: its bearer key; max_context:
    the most tokens one generation may hold (at most the replica's `max_len`); model: the served
    model id to send (default: none, the replica's own)."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        tok: Tokenizer,
        *,
        max_context: int,
        model: str | None = None,
        timeout_s: float = 600.0,
        full_retries: int = 20,
        full_wait_s: float = 0.25,
        http: httpx.AsyncClient | None = None,
    ):
        if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 2:
            raise ValueError(f"max_context={max_context!r}; accepted: an int >= 2")
        if full_retries < 0 or full_wait_s < 0:
            raise ValueError(f"full_retries={full_retries}, full_wait_s={full_wait_s}; accepted: both >= 0")
        self.base_url = api_root(base_url)
        self.tok, self.max_context, self.model = tok, max_context, model
        self.full_retries, self.full_wait_s = full_retries, full_wait_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = http or httpx.AsyncClient(timeout=timeout_s, headers=headers)
        self.closed = False

    async def sample(self, tokens: list[int], req: TurnRequest) -> Sampled:
        body: dict[str, Any] = {
            "prompt": list(map(int, tokens)),
            "max_tokens": req.max_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "seed": req.seed,
            "logprobs": 0,
            "stop_token_ids": list(self.chat.end_of_turn),
            "ignore_eos": True,
            "return_routing": True,
            "return_prompt_routing": True,
        }
        if self.model is not None:
            body["model"] = self.model
        return self._parse(await self._post(body), len(tokens))

    async def _post(self, body: dict) -> dict:
        where = f"sampler {self.base_url}"
        if self.closed:
            raise SamplerUnavailable(f"{where}: this policy is closed")
        dropped, attempt = 0, -1
        while True:
            attempt += 1
            try:
                resp = await self.http.post(f"{self.base_url}/v1/completions", json=body)
            except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as e:
                # a dropped connection (often a pooled keep-alive one the server just closed): asked
                # again on a new one; a replica that is gone then refuses the connection
                dropped += 1
                if dropped <= 2:
                    attempt -= 1
                    continue
                raise SamplerUnavailable(f"{where}: {type(e).__name__} ({dropped} times): {e}") from e
            except httpx.TransportError as e:  # refused, timed out: the replica is gone or stuck
                raise SamplerUnavailable(f"{where}: {type(e).__name__}: {e}") from e
            except RuntimeError as e:  # httpx: the client has been closed
                raise SamplerUnavailable(f"{where}: {e}") from e
            if resp.status_code == 429 and attempt < self.full_retries:
                await asyncio.sleep(self.full_wait_s)
                continue
            break
        return answer_json(resp, where)

    def _parse(self, data: dict, prompt_len: int) -> Sampled:
        """The answer's tokens, logprobs, versions and routing int32[prompt + generated - 1, layers, k]."""
        try:
            choice = data["choices"][0]
            tokens = [int(t) for t in choice["token_ids"]]
            logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            versions = [int(v) for v in choice["token_versions"]]
            routed, prompt_routed = choice.get("routed_experts"), choice.get("prompt_routed_experts")
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise SamplerUnavailable(
                f"sampler {self.base_url}: the answer lacks the token-level fields ({type(e).__name__}: {e}); "
                "a composer-jax serve replica (or an engine with token_ids, token_versions, logprobs) is needed"
            ) from e
        if not tokens or not len(tokens) == len(logprobs) == len(versions):
            raise SamplerUnavailable(
                f"sampler {self.base_url}: {len(tokens)} token_ids, {len(logprobs)} logprobs, "
                f"{len(versions)} token_versions; expected equal, non-zero counts"
            )
        if routed is None and prompt_routed is None:
            return Sampled(tokens, logprobs, versions)
        rows = np.asarray((prompt_routed or []) + (routed or []), np.int32)
        if rows.ndim != 3 or rows.shape[0] != prompt_len + len(tokens) - 1:
            raise SamplerUnavailable(
                f"sampler {self.base_url}: routed experts of shape {list(rows.shape)}; expected "
                f"[{prompt_len + len(tokens) - 1}, moe_layers, k] (prompt + generated - 1 positions)"
            )
        return Sampled(tokens, logprobs, versions, rows)

    async def load_version(self, version: int, store_url: str | None = None) -> int:
        """Have the replica serve `version` of its weight-sync store (`store_url`, default the one it
        follows) from its next decode step on, through `POST /admin/load_weights`; returns once a
        decode step ran with it (requests in flight continue). A replica already serving it or a
        newer one (it polled first: 409) counts as done. SamplerUnavailable when it cannot."""
        where = f"sampler {self.base_url}"
        if self.closed:
            raise SamplerUnavailable(f"{where}: this policy is closed")
        body: dict[str, Any] = {"source": "weight_store", "version": int(version)}
        if store_url:
            body["url"] = store_url
        try:
            resp = await self.http.post(f"{self.base_url}/admin/load_weights", json=body)
        except (httpx.TransportError, RuntimeError) as e:
            raise SamplerUnavailable(f"{where}: loading version {version}: {type(e).__name__}: {e}") from e
        if resp.status_code == 409:
            return int(version)
        if resp.status_code >= 400:
            raise SamplerUnavailable(f"{where}: loading version {version}: HTTP {resp.status_code}: {resp.text[:500]}")
        try:
            return int(resp.json()["version"])
        except (ValueError, KeyError, TypeError) as e:
            raise SamplerUnavailable(f"{where}: loading version {version}: malformed answer {resp.text[:300]}") from e

    async def health(self) -> dict:
        """The replica's `/health` (policy version, decode steps, slot occupancy, ...);
        SamplerUnavailable when it does not answer."""
        try:
            resp = await self.http.get(f"{self.base_url}/health")
            resp.raise_for_status()
            return dict(resp.json())
        except (httpx.HTTPError, ValueError, RuntimeError) as e:
            raise SamplerUnavailable(f"sampler {self.base_url}: /health: {type(e).__name__}: {e}") from e

    async def metrics(self) -> str:
        """The replica's `/metrics` exposition; SamplerUnavailable when it does not answer."""
        try:
            resp = await self.http.get(f"{self.base_url}/metrics")
            resp.raise_for_status()
            return resp.text
        except (httpx.HTTPError, RuntimeError) as e:
            raise SamplerUnavailable(f"sampler {self.base_url}: /metrics: {type(e).__name__}: {e}") from e

    async def aclose(self) -> None:
        self.closed = True
        await self.http.aclose()


class ServeReplicas(ReplicaBackend):
    """The serve replica backend (module docstring): one `RemoteTokenPolicy` per replica, loading
    versions from the weight store at `store_url` (None: the store each replica follows)."""

    replicas: list[RemoteTokenPolicy]

    def __init__(self, policies: list[RemoteTokenPolicy], store_url: str | None = None):
        self.replicas, self.store_url = list(policies), store_url or None
        self.policies = list(self.replicas)

    @classmethod
    def connect(
        cls, urls: list[str], api_key: str, tok: Tokenizer, *, max_context: int, store_url: str | None = None
    ) -> ServeReplicas:
        return cls([RemoteTokenPolicy(u, api_key, tok, max_context=max_context) for u in urls], store_url)

    async def publish(self, params: Any, version: int) -> None:
        del params, version  # the replicas read the version from the weight store the learner wrote

    async def load(self, version: int, pool: PolicyPool) -> None:
        """Every replica in rotation serves `version`, all loading at once (each keeps decoding)."""
        alive = [p for p in self.replicas if p in pool.alive]
        await asyncio.gather(*(self.load_or_remove(pool, p, p.load_version(version, self.store_url)) for p in alive))

    async def profile_counters(self) -> dict[str, dict[str, float]]:
        """Each open replica's profile counters from its /metrics (runtime/profile.py `counters_of`), by
        URL; one that does not answer is left out."""

        async def one(p: RemoteTokenPolicy) -> tuple[str, dict[str, float]] | None:
            try:
                return p.base_url, counters_of(await p.metrics())
            except (SamplerUnavailable, ValueError):  # (ValueError: an exposition the parser refuses)
                return None

        got = await asyncio.gather(*(one(p) for p in self.replicas if not p.closed))
        return dict(x for x in got if x is not None)
