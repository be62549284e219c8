"""The vLLM backend: samplers that are vLLM replicas (`rl.sampler_engine: vllm`; started by the run,
rl/samplers/vllm_launch.py, or given by URL and fed over NCCL, vllm_nccl.py).

`VLLMTokenPolicy` is the in-process `TokenPolicy` over vLLM's token-in/token-out endpoint
`POST /inference/v1/generate` (vLLM >= 0.32, `--enable-scale-out`): the same chat template and the
same `Generation` records as the in-process sampler and `composer-jax serve` replicas. Each turn
sends the whole context as `token_ids` with `sampling_params` (temperature, top_p, top_k, seed,
max_tokens, `logprobs: 0`: the sampled token's log-probability, `stop_token_ids: [<|im_end|>]`,
`ignore_eos`, no detokenisation) and records from the answer's choice:

* `token_ids`: the model's own tokens verbatim (the stop token included);
* `logprobs.content[i].logprob`: with the replica started with `--logprobs-mode
  processed_logprobs`, the log-probability under the distribution the token was drawn from (after
  temperature), which is what the trainer's importance ratio divides by (rl.loss.temperature);
* `weight_versions`: spans `{version, start, end}` over the output tokens, mapped to one policy
  version per token (the staleness bound and the importance ratio use them). The replica's weights
  are labelled with the policy version by `composer-jax vllm-replica` (`/update_weight_version`) or
  by the NCCL update's `/finish_weight_update`; an unlabelled replica ("default") is an error;
* `routed_experts` (base64 `.npy`, `[prompt + generated - 1, moe_layers, k]`) when the replica was
  started with `--enable-return-routed-experts`: router replay, as from the project's sampler.

New versions come through `load_version`, which the policy leaves to its `weights` (a
`WeightPush`: a restart of the replica on the version's exported checkpoint, or vLLM's NCCL
weight-transfer routes). While a version is being loaded the policy's requests wait; a request cut
by a restart is asked again on the new weights (it had produced nothing: a turn is one request).
Failures map as for `RemoteTokenPolicy`: `SamplerUnavailable` (redo the rollout elsewhere) for a
replica that cannot serve, ValueError for a request it refuses (400).

`VLLMReplicas` is the backend: each version goes to the push first (`export`), then the replicas
load it: one after another when the run is asynchronous (the others keep sampling meanwhile),
together when synchronous (no group samples until all do).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
from collections.abc import Sequence
from typing import Any, Protocol

import httpx
import numpy as np

from composer_jax.formats.tokenizer import Tokenizer
from composer_jax.rl.samplers.base import ReplicaBackend, Sampled, TokenSampler
from composer_jax.rl.samplers.policy import PolicyPool, SamplerUnavailable, TurnRequest
from composer_jax.rl.samplers.serve import answer_json, api_root

GENERATE_PATH = "/inference/v1/generate"


class WeightPush(Protocol):
    """How replicas get policy versions: `export` takes each version's weights first (the checkpoint
    a restart reads, rl/samplers/vllm_launch.py; the next NCCL broadcast's, vllm_nccl.py), then
    `load` has one replica serve it; `holding(version)` spans the replicas' loads of a version,
    queued and in flight, so that what they read is kept meanwhile."""

    def export(self, params: Any, version: int) -> Any: ...

    def holding(self, version: int) -> contextlib.AbstractContextManager[None]: ...

    async def load(self, policy: VLLMTokenPolicy, version: int) -> None: ...


def generate_body(
    tokens: list[int], req: TurnRequest, stop: int | Sequence[int], model: str | None = None
) -> dict[str, Any]:
    """The `/inference/v1/generate` request of one turn (vLLM's `GenerateRequest`)."""
    body: dict[str, Any] = {
        "token_ids": [int(t) for t in tokens],
        "sampling_params": {
            "max_tokens": int(req.max_tokens),
            "temperature": float(req.temperature),
            "top_p": float(req.top_p),
            "top_k": int(req.top_k) if req.top_k > 0 else -1,  # vLLM: -1 = every token
            "seed": int(req.seed),
            "logprobs": 0,  # the sampled token's own
            "stop_token_ids": [int(stop)] if isinstance(stop, int) else [int(t) for t in stop],
            "ignore_eos": True,  # stop at the end of the turn only, as the project's sampler
            "detokenize": False,
            "skip_special_tokens": False,
        },
        "output_mode": "tokens",
    }
    if model is not None:
        body["model"] = model
    return body


def token_versions(spans: Any, n: int, where: str) -> list[int]:
    """vLLM's `weight_versions` spans over `n` output tokens -> one int version per token."""
    out = [-2] * n
    if not isinstance(spans, list) or not spans:
        raise SamplerUnavailable(f"{where}: no weight_versions in the answer (vLLM >= 0.32 gives them)")
    for span in spans:
        try:
            label, start, end = span["version"], int(span["start"]), int(span["end"])
        except (KeyError, TypeError, ValueError) as e:
            raise SamplerUnavailable(f"{where}: malformed weight_versions span {span!r}") from e
        try:
            version = int(label)
        except (TypeError, ValueError):
            raise SamplerUnavailable(
                f"{where}: its weights are labelled {label!r}, not a policy version; a replica must be started "
                "by `composer-jax vllm-replica --version V` or labelled with POST /update_weight_version"
            ) from None
        if not 0 <= start <= end <= n:
            raise SamplerUnavailable(f"{where}: weight_versions span [{start}, {end}) outside the {n} output tokens")
        out[start:end] = [version] * (end - start)
    if -2 in out:
        raise SamplerUnavailable(f"{where}: weight_versions spans {spans!r} do not cover the {n} output tokens")
    return out


def decode_routed_experts(text: str) -> np.ndarray:
    """vLLM's `routed_experts` (base64 of `.npy` bytes) -> int32[positions, moe_layers, k]."""
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False).astype(np.int32)


class VLLMTokenPolicy(TokenSampler):
    """The token policy over one vLLM replica (module docstring). base_url: `http://host:port`;
    weights: how it gets new versions; routed_experts: the replica returns them (router replay);
    api_key: the replica's, sent as `Authorization: Bearer` with every request of `http`."""

    def __init__(
        self,
        base_url: str,
        tok: Tokenizer,
        *,
        max_context: int,
        weights: WeightPush | None = None,
        routed_experts: bool = False,
        api_key: str = "",
        model: str | None = None,
        timeout_s: float = 600.0,
        http: httpx.AsyncClient | None = None,
        index: int = 0,
    ):
        if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 2:
            raise ValueError(f"max_context={max_context!r}; accepted: an int >= 2")
        self.base_url, self.tok, self.max_context, self.model = api_root(base_url), tok, max_context, model
        self.weights, self.routed_experts, self.index = weights, routed_experts, index
        self.http = http or httpx.AsyncClient(timeout=timeout_s)
        if api_key:  # on the client, so every route's request carries it (the weight pushes' too)
            self.http.headers["Authorization"] = f"Bearer {api_key}"
        self.closed = False
        self.version: int | None = None  # the version it serves, once a load finished
        self._serving = asyncio.Event()  # cleared while a version is being loaded
        self._serving.set()
        self._loads = 0  # versions loaded so far: a request that spans one is asked again
        self._lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"VLLMTokenPolicy({self.base_url})"

    async def sample(self, tokens: list[int], req: TurnRequest) -> Sampled:
        data = await self._post(generate_body(tokens, req, self.chat.end_of_turn, self.model))
        return self._parse(data, len(tokens))

    async def _post(self, body: dict) -> dict:
        where = f"vLLM sampler {self.base_url}"
        dropped = 0
        while True:
            if self.closed:
                raise SamplerUnavailable(f"{where}: this policy is closed")
            await self._serving.wait()
            loads = self._loads
            try:
                resp = await self.http.post(self.base_url + GENERATE_PATH, json=body)
            except httpx.TransportError as e:
                if self._loads != loads or not self._serving.is_set():  # cut by a planned restart
                    continue
                dropped += 1
                if dropped <= 2 and isinstance(e, httpx.ReadError | httpx.WriteError | httpx.RemoteProtocolError):
                    continue
                raise SamplerUnavailable(f"{where}: {type(e).__name__}: {e}") from e
            except RuntimeError as e:  # httpx: the client has been closed
                raise SamplerUnavailable(f"{where}: {e}") from e
            if resp.status_code >= 500 and (self._loads != loads or not self._serving.is_set()):
                continue  # aborted by a weight update
            break
        return answer_json(resp, where)

    def _parse(self, data: dict, prompt_len: int) -> Sampled:
        """The answer's tokens, logprobs, versions and routing int32[prompt + generated - 1, layers, k]."""
        where = f"vLLM sampler {self.base_url}"
        try:
            choice = data["choices"][0]
            tokens = [int(t) for t in choice["token_ids"]]
            content = choice["logprobs"]["content"]
            logprobs = [float(c["logprob"]) for c in content]
            picked = [int(c["token_id"]) for c in content]
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise SamplerUnavailable(
                f"{where}: the answer lacks token_ids or logprobs.content ({type(e).__name__}: {e}); "
                "the replica must serve vLLM's /inference/v1/generate (--enable-scale-out)"
            ) from e
        if not tokens or picked != tokens:
            raise SamplerUnavailable(
                f"{where}: {len(tokens)} token_ids and {len(picked)} logprobs of other tokens; expected one "
                "logprob of each sampled token"
            )
        versions = token_versions(choice.get("weight_versions"), len(tokens), where)
        raw = choice.get("routed_experts")
        if not self.routed_experts:
            return Sampled(tokens, logprobs, versions)
        if not isinstance(raw, str):
            raise SamplerUnavailable(
                f"{where}: no routed_experts in the answer; start vLLM with --enable-return-routed-experts "
                "or set rl.vllm.routed_experts=false (router replay off)"
            )
        rows = decode_routed_experts(raw)
        if rows.ndim != 3 or rows.shape[0] != prompt_len + len(tokens) - 1:
            raise SamplerUnavailable(
                f"{where}: routed experts of shape {list(rows.shape)}; expected "
                f"[{prompt_len + len(tokens) - 1}, moe_layers, k] (prompt + generated - 1 positions)"
            )
        return Sampled(tokens, logprobs, versions, rows)

    async def load_version(self, version: int, store_url: str | None = None) -> int:
        """Serve policy `version` from now on (through `weights`); requests wait meanwhile."""
        del store_url  # vLLM cannot read the weight store: the push carries the weights
        if self.weights is None:
            raise SamplerUnavailable(f"vLLM sampler {self.base_url}: no way to load version {version} was given")
        async with self._lock:
            if self.version is not None and self.version >= version:
                return self.version
            self._serving.clear()
            self._loads += 1
            try:
                await self.weights.load(self, int(version))
            except SamplerUnavailable:
                raise
            except Exception as e:
                raise SamplerUnavailable(f"vLLM sampler {self.base_url}: loading version {version}: {e}") from e
            finally:
                self._serving.set()
            self.version = int(version)
            return self.version

    async def health(self) -> dict:
        """vLLM's /health and the version its weights are labelled with (`/weight_info`)."""
        try:
            (await self.http.get(self.base_url + "/health")).raise_for_status()
            info = (await self.http.get(self.base_url + "/weight_info")).json()
        except (httpx.HTTPError, ValueError, RuntimeError) as e:
            raise SamplerUnavailable(f"vLLM sampler {self.base_url}: /health: {type(e).__name__}: {e}") from e
        return {"url": self.base_url, "engine": "vllm", "weight_version": info.get("weight_version")}

    async def aclose(self) -> None:
        self.closed = True
        self._serving.set()
        await self.http.aclose()


class VLLMReplicas(ReplicaBackend):
    """The vLLM backend (module docstring): `policies`, one per replica, all fed by `push`;
    together: load versions on every replica at once (a synchronous run)."""

    cancel_loads_at_close = True  # a restart nothing will sample from any more

    replicas: list[VLLMTokenPolicy]

    def __init__(self, policies: list[VLLMTokenPolicy], push: WeightPush, *, together: bool):
        self.replicas, self.push, self.together = list(policies), push, together
        self.policies = list(self.replicas)

    async def publish(self, params: Any, version: int) -> None:
        await asyncio.to_thread(self.push.export, params, version)

    async def load(self, version: int, pool: PolicyPool) -> None:
        with self.push.holding(version):  # until the last replica has loaded it
            alive = [p for p in self.replicas if p in pool.alive]
            if self.together:
                await asyncio.gather(*(self.load_or_remove(pool, p, p.load_version(version)) for p in alive))
            else:
                for p in alive:
                    await self.load_or_remove(pool, p, p.load_version(version))
