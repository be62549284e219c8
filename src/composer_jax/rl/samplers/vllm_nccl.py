"""New policy versions for running vLLM replicas over NCCL (`rl.vllm.weight_update: nccl`, GPU fleets).

vLLM (0.32, dev-mode routes, `--weight-transfer-config '{"backend": "nccl"}'`) receives weights by
NCCL broadcast from rank 0 of a group it joins. A JAX trainer has no torch to join vLLM's TCPStore
rendezvous, so it mints the NCCL unique id itself (vLLM's `nccl_unique_id_b64` path, standard
base64 of the 128 bytes of `ncclGetUniqueId`) and drives rank 0 through libnccl directly (ctypes;
the library `jax[cuda]` installs, `nvidia-nccl-cu12`, or COMPOSER_JAX_NCCL_LIB):

* connect, once: every replica's world size (`GET /get_world_size?include_dp=false`), then
  `POST /init_weight_transfer_engine {"init_info": {"nccl_unique_id_b64", "rank_offset",
  "world_size", "packed": false}}` to all of them while this process joins as rank 0
  (`ncclCommInitRank`) and answers the workers' one-element warm-up `all_reduce`; then the replicas'
  weights are labelled with the run's first version (`POST /update_weight_version`): they must have
  been started from the same checkpoint.
* each version: `POST /pause?mode=keep` (requests in flight wait, none is lost), `POST
  /start_weight_update`, then `POST /update_weights {"update_info": {"names", "dtype_names",
  "shapes"}}` to every replica while this process broadcasts the tensors in that order (one
  `ncclBroadcast` each, Hugging Face names and layout: `checkpoint.hf.hf_tensors`), `POST
  /finish_weight_update {"weight_version": "N"}` (vLLM labels the tokens sampled from here on N) and
  `POST /resume`. One update serves every replica of the group: the first `load` of a version does
  it, later ones for the same version return at once.

The request bodies are checked against vLLM's own classes (tests/rl/samplers/test_vllm_policy.py); the
broadcasts need GPUs and run when a device is lent (docs/scaling.md).
"""

from __future__ import annotations

import asyncio
import base64
import ctypes
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from composer_jax.config import Config
from composer_jax.hf.weights import hf_tensors
from composer_jax.rl.samplers.policy import SamplerUnavailable
from composer_jax.rl.samplers.vllm import VLLMTokenPolicy

# ncclDataType_t
NCCL_DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5}
NCCL_DTYPES |= {"float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
NCCL_SUM = 0


def init_body(unique_id: bytes, rank_offset: int, world_size: int) -> dict[str, Any]:
    """`/init_weight_transfer_engine`'s body (vLLM's `NCCLWeightTransferInitInfo`, unique-id mode)."""
    if len(unique_id) != 128:
        raise ValueError(f"an NCCL unique id is 128 bytes, not {len(unique_id)}")
    info = {"nccl_unique_id_b64": base64.b64encode(unique_id).decode(), "rank_offset": int(rank_offset)}
    return {"init_info": info | {"world_size": int(world_size), "packed": False}}


def update_body(specs: Sequence[tuple[str, str, tuple[int, ...], Any]]) -> dict[str, Any]:
    """`/update_weights`'s body (vLLM's `NCCLWeightTransferUpdateInfo`) for `hf_tensors` specs."""
    info = {"names": [s[0] for s in specs], "dtype_names": [s[1] for s in specs], "shapes": [list(s[2]) for s in specs]}
    return {"update_info": info}


def finish_body(version: int) -> dict[str, Any]:
    return {"weight_version": str(int(version))}


def load_nccl() -> ctypes.CDLL:
    """libnccl: COMPOSER_JAX_NCCL_LIB, the nvidia-nccl wheel's, or the system's."""
    names = [os.environ.get("COMPOSER_JAX_NCCL_LIB", "")]
    try:
        import nvidia.nccl

        names.append(str(Path(list(nvidia.nccl.__path__)[0]) / "lib" / "libnccl.so.2"))
    except ImportError:
        pass
    names.append("libnccl.so.2")
    for name in filter(None, names):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SamplerUnavailable(
        "rl.vllm.weight_update=nccl: libnccl.so.2 not found (install jax[cuda12] or nvidia-nccl-cu12, or set "
        "COMPOSER_JAX_NCCL_LIB)"
    )


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


class NcclRankZero:
    """This process as rank 0 of the trainer + replicas group (libnccl through ctypes)."""

    def __init__(self) -> None:
        self.lib = load_nccl()
        self.uid = _UniqueId()
        self._check(self.lib.ncclGetUniqueId(ctypes.byref(self.uid)), "ncclGetUniqueId")
        self.comm = ctypes.c_void_p()

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise SamplerUnavailable(f"{what} failed: NCCL error {rc}")

    @property
    def unique_id(self) -> bytes:
        return bytes(self.uid.internal)

    def join(self, world_size: int) -> None:
        """ncclCommInitRank as rank 0 (blocks until every worker joined), then the warm-up all_reduce."""
        import jax.numpy as jnp

        rc = self.lib.ncclCommInitRank(ctypes.byref(self.comm), ctypes.c_int(world_size), self.uid, ctypes.c_int(0))
        self._check(rc, "ncclCommInitRank")
        one = jnp.zeros((1,), jnp.float32).block_until_ready()
        ptr = ctypes.c_void_p(one.unsafe_buffer_pointer())
        rc = self.lib.ncclAllReduce(ptr, ptr, ctypes.c_size_t(1), NCCL_DTYPES["float32"], NCCL_SUM, self.comm, None)
        self._check(rc, "ncclAllReduce (warm-up)")
        self._sync()

    def broadcast(self, specs: Sequence[tuple[str, str, tuple[int, ...], Any]]) -> None:
        """Each tensor in order from rank 0 (host array -> this process's first GPU -> the group)."""
        import jax

        device = jax.local_devices()[0]
        for name, dtype_name, _shape, make in specs:
            x = jax.device_put(make(), device).block_until_ready()
            ptr = ctypes.c_void_p(x.unsafe_buffer_pointer())
            rc = self.lib.ncclBroadcast(ptr, ptr, ctypes.c_size_t(x.size), NCCL_DTYPES[dtype_name], 0, self.comm, None)
            self._check(rc, f"ncclBroadcast of {name}")
            self._sync()  # x must live until the broadcast is done

    def _sync(self) -> None:
        cudart = ctypes.CDLL("libcudart.so.12")
        self._check(cudart.cudaDeviceSynchronize(), "cudaDeviceSynchronize")


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
        self.rank0 = rank0 = NcclRankZero()
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        world = 1 + sum(sizes)
        posts = [
            self._post(p.http, p.base_url + "/init_weight_transfer_engine", init_body(rank0.unique_id, off, world))
            for p, off in zip(policies, offsets, strict=True)
        ]
        await asyncio.gather(asyncio.to_thread(rank0.join, world), *posts)
        for p in policies:
            await self._post(p.http, p.base_url + "/update_weight_version", {"new_version": str(int(version))})
            p.version = int(version)

    def export(self, params: Any, version: int) -> None:
        """The weights of version `version`, to push at its `load` (the rollout side hands them over
        first, as it exports them for restarted replicas)."""
        del version
        self.params = params

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
