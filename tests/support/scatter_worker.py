"""One process of a multi-process `scatter_arrays` check (run by tests/test_multihost_scatter.py,
not by pytest).

usage: python scatter_worker.py PROCESS_ID NUM_PROCESSES DEVICES_PER_PROCESS PORT AXES SIZES

Joins the job (gloo), builds a mesh of AXES (comma-separated names) of SIZES over every device, and
scatters process 0's batch-like arrays (rows over every axis but `t`, which replicates them) with
`scatter_arrays`. Each process checks each of its shards against numpy slices of the same arrays
(rebuilt from the seed: the others never see process 0's copy) and a jitted global sum against
numpy's, then prints `ok received=[...]` (bytes each process received, by the plan).
"""

from __future__ import annotations

import sys

import jax
import numpy as np


def batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "tokens": rng.integers(0, 100, (8, 6)).astype(np.int32),
        "advantages": rng.normal(size=(8, 6)).astype(np.float32),
        "routing": rng.integers(0, 8, (8, 6, 2, 3)).astype(np.int32),  # [rows, T, moe_layers, k]
    }


def main() -> None:
    pid, n, ndev, port = (int(x) for x in sys.argv[1:5])
    axes, sizes = sys.argv[5].split(","), tuple(int(x) for x in sys.argv[6].split(","))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", ndev)
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=n, process_id=pid)
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from composer_jax.multihost import scatter_arrays

    mesh = jax.make_mesh(sizes, tuple(axes), axis_types=(AxisType.Auto,) * len(axes))
    sharding = NamedSharding(mesh, PartitionSpec(tuple(a for a in axes if a != "t"), None))
    want = batch()
    out, received = scatter_arrays(want if pid == 0 else None, sharding)
    for k, v in out.items():
        assert v.sharding == sharding and v.shape == want[k].shape and v.dtype == want[k].dtype, k
        for s in v.addressable_shards:
            assert np.array_equal(np.asarray(s.data), want[k][s.index]), (k, s.index)
    total = jax.jit(lambda x: x.sum())(out["routing"])
    assert int(total) == int(want["routing"].sum())
    print(f"ok received={received}", flush=True)


if __name__ == "__main__":
    main()
