"""NCCL transport of weights to running vLLM replicas: vLLM's weight-transfer request bodies, and
this process as rank 0 of the NCCL group the replicas join.

vLLM (0.32, dev-mode routes, `--weight-transfer-config '{"backend": "nccl"}'`) receives weights by
NCCL broadcast from rank 0 of a group it joins. A JAX trainer has no torch to join vLLM's TCPStore
rendezvous, so it mints the NCCL unique id itself (vLLM's `nccl_unique_id_b64` path, standard
base64 of the 128 bytes of `ncclGetUniqueId`) and drives rank 0 through libnccl directly (ctypes;
the library `jax[cuda]` installs, `nvidia-nccl-cu12`, or COMPOSER_JAX_NCCL_LIB): `init_body`,
`update_body` and `finish_body` are what the replicas are sent, `NcclRankZero` joins the group
(`ncclCommInitRank` and the workers' one-element warm-up `all_reduce`) and broadcasts each tensor
of `hf.weights.hf_tensors` in order. Which replicas are sent what, and when, is the policy side's
(rl/samplers/vllm_nccl.py). Failures raise `NCCLError`.

The request bodies are checked against vLLM's own classes (tests/rl/samplers/test_vllm_policy.py); the
broadcasts need GPUs and run when a device is lent (docs/scaling.md).
"""

from __future__ import annotations

import base64
import ctypes
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class NCCLError(RuntimeError):
    """libnccl is missing, or an NCCL or CUDA call failed (the message names the call and its code)."""


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
    raise NCCLError("libnccl.so.2 not found (install jax[cuda12] or nvidia-nccl-cu12, or set COMPOSER_JAX_NCCL_LIB)")


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
            raise NCCLError(f"{what} failed: NCCL error {rc}")

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
