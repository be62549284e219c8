"""New policy versions for running vLLM replicas over NCCL (`rl.vllm.weight_update: nccl`, GPU fleets):
the vLLM backend's `WeightPush` over the NCCL transport (weightsync/nccl.py).

* connect, once: every replica's world size (`GET /get_world_size?include_dp=false`), then
  `POST /init_weight_transfer_engine {"init_info": {"nccl_unique_id_b64", "rank_offset",
  "world_size", "packed": false}}` to all of them while this process joins as rank 0
  (`ncclCommInitRank`) and answers the workers' one-element warm-up `all_reduce`; then the replicas'
  weights are labelled with the run's first version (`POST /update_weight_version`): they must have
  been started from the same checkpoint.
* each version: `POST /pause?mode=keep` (requests in flight wait, none is lost), `POST
  /start_weight_update`, then `POST /update_weights {"update_info": {"names", "dtype_names",
  "shapes"}}` to every replica while this process broadcasts the tensors in that order (one
  `ncclBroadcast` each, Hugging Face names and layout: `hf.weights.hf_tensors`), `POST
  /finish_weight_update {"weight_version": "N"}` (vLLM labels the tokens sampled from here on N) and
  `POST /resume`. One update serves every replica of the group: the first `load` of a version does
  it, later ones for the same version return at once.

A transport failure (`NCCLError`) is a `SamplerUnavailable` here: the replicas cannot take the version.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx

from composer_jax.config import Config
from composer_jax.hf.weights import hf_tensors
from composer_jax.rl.samplers.policy import SamplerUnavailable
from composer_jax.rl.samplers.vllm import VLLMTokenPolicy
from composer_jax.weightsync.nccl import NCCLError, NcclRankZero, finish_body, init_body, update_body


class NCCLPush:
    """The `WeightPush` of replicas by URL (module docstring)."""

    def __init__(self, cfg: Config, host: str):
        self.cfg, self.host = cfg, host
        self.policies: list[VLLMTokenPolicy] = []
        self.rank0: NcclRankZero | None = None
        self.params: Any = None
        self._done: dict[int, asyncio.Future] = {}

    async def _post(self, http: httpx.AsyncClient, url: str, body: dict | None = None, **params: Any) -> Any:
        resp = await http.post(url, json=body, params=params or None)
        if resp.status_code >= 400:
            raise SamplerUnavailable(f"{url}: HTTP {resp.status_code}: {resp.text[:300]}")
        return resp.json()

    async def connect(self, policies: list[VLLMTokenPolicy], params: Any, version: int) -> None:
        self.policies, self.params = policies, params
        sizes = []
        for p in policies:
            resp = await p.http.get(p.base_url + "/get_world_size", params={"include_dp": "false"})
            sizes.append(int(resp.json()["world_size"]))
        try:
            self.rank0 = rank0 = NcclRankZero()
        except NCCLError as e:
            raise SamplerUnavailable(f"rl.vllm.weight_update=nccl: {e}") from e
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        world = 1 + sum(sizes)
        posts = [
            self._post(p.http, p.base_url + "/init_weight_transfer_engine", init_body(rank0.unique_id, off, world))
            for p, off in zip(policies, offsets, strict=True)
        ]
        try:
            await asyncio.gather(asyncio.to_thread(rank0.join, world), *posts)
        except NCCLError as e:
            raise SamplerUnavailable(f"joining the replicas' NCCL group: {e}") from e
        for p in policies:
            await self._post(p.http, p.base_url + "/update_weight_version", {"new_version": str(int(version))})
            p.version = int(version)

    def export(self, params: Any, version: int) -> None:
        """The weights of version `version`, to push at its `load` (the rollout side hands them over
        first, as it exports them for restarted replicas)."""
        del version
        self.params = params

    def holding(self, version: int) -> contextlib.AbstractContextManager[None]:
        """Nothing to keep: an update sends the weights `export` was given last."""
        del version
        return contextlib.nullcontext()

    async def load(self, policy: VLLMTokenPolicy, version: int) -> None:
        if version not in self._done:
            self._done[version] = asyncio.ensure_future(self._update(version))
        await asyncio.shield(self._done[version])

    async def _update(self, version: int) -> None:
        assert self.rank0 is not None, "connect first"
        specs = hf_tensors(self.params, self.cfg.model, dtype=self.cfg.rl.vllm.dtype)
        ps = self.policies
        await asyncio.gather(*(self._post(p.http, p.base_url + "/pause", mode="keep") for p in ps))
        try:
            await asyncio.gather(*(self._post(p.http, p.base_url + "/start_weight_update") for p in ps))
            body = update_body(specs)
            await asyncio.gather(
                asyncio.to_thread(self.rank0.broadcast, specs),
                *(self._post(p.http, p.base_url + "/update_weights", body) for p in ps),
            )
            await asyncio.gather(
                *(self._post(p.http, p.base_url + "/finish_weight_update", finish_body(version)) for p in ps)
            )
        finally:
            await asyncio.gather(*(self._post(p.http, p.base_url + "/resume") for p in ps), return_exceptions=True)
