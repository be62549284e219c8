"""Expert parallelism: exchanging (token, expert) assignments over the expert mesh axis.

Inside `jax.shard_map` each device holds `a = tokens x k` assignments sorted by global expert and
`e_local = E / ep` experts. Two exchange strategies (`model.moe_ep_exchange`):

padded (the reference; the only one XLA:CPU runs): every device sends a worst-case `[ep, a, d]`
  buffer through `all_to_all`, one `a`-row slot per destination, so the exchange moves `ep` x the
  rows that exist and the receiving grouped matmul runs over `ep x a` rows, most of them padding.
  Nothing is ever dropped.

ragged (`jax.lax.ragged_all_to_all`, GPU and TPU): the per-(device, expert) counts are exchanged
  first (an all_gather of `ep x E` int32), every device derives the same offsets from them
  (`ragged_plan`, a pure function), then only the real rows move, into a receive buffer of
  `ragged_buffer_rows` rows; the local experts run on those rows only (`ragged_dot` group sizes)
  and the inverse ragged exchange returns them. XLA:CPU has no `ragged-all-to-all` (jax 0.10.2:
  "HLO opcode `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter"), so on CPU the same
  bookkeeping runs with the collective emulated by a padded `all_to_all`
  (`ragged_all_to_all_emulated`, `moe_ep_exchange=ragged_emulated`): the tests hold it equal to the
  padded path, and the real op is checked by lowering for CUDA.

The receive buffer bound (`ragged_buffer_rows`). A device receives `a` rows on average (the
balanced share: `ep x a` assignments over `ep` devices). The most it can receive is when every
token of every device picks as many of its experts as it can on that one device:
`min(k, e_local)` per token, i.e. `ep x tokens x min(k, e_local) = a x min(ep, E / k)` rows (the
same worst case as MaxText's `get_ragged_buffer_size`: a factor of `ep` while `e_local >= k`, at
most `E / k` beyond). `model.moe_ep_capacity_factor = 0` sizes the buffer for that worst case, so
nothing can be dropped; `c > 0` sizes it at `ceil(c x a)` rows (capped at the worst case), which
cuts the receive buffer, the expert matmul rows and their activations by `worst / c` at the risk of
overflow.

Overflow policy: dropped and counted. Each receiver packs its sources in device order and each
source's rows in expert order; rows past the bound are not sent, their expert output is zero (the
token keeps its other experts and the shared expert, as with capacity-limited routers), and the
count of dropped assignments is a statistic of the layer (`moe_dropped`, a logged metric of the
train step), so "dropless" is measured rather than assumed. The drop falls on the last sources and
the highest local experts of a full receiver: it is deterministic, not fair.

Communication volume (`exchange_traffic`): per MoE layer and exchange, the padded strategy sends
`(ep - 1) x a` rows of `hidden` values off each device, the ragged one the rows routed off-device,
`a (ep - 1) / ep` under uniform routing (at most `a`): `ep` x fewer. A training step makes each
exchange (dispatch and combine) once forward and once backward (the transposes), and once more when
the layer is recomputed (`model.remat` != none).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from einops import rearrange, reduce

from composer_jax.config import ModelConfig
from composer_jax.config.model import MOE_EP_EXCHANGES
from composer_jax.model.moe.dispatch import on_accelerator

# Compute on the received rows: (rows [R, d] sorted by local expert, sizes int32[e_local]) -> [R, d]
ExpertCompute = Callable[[jax.Array, jax.Array], jax.Array]

# the exchanges model.moe_ep_exchange names ("auto" picks one of them per platform)
EXCHANGES = tuple(e for e in MOE_EP_EXCHANGES if e != "auto")


def ep_exchange(cfg: ModelConfig) -> str:
    """The expert-parallel exchange `cfg.moe_ep_exchange` names, "auto" resolved for this backend:
    the ragged all-to-all on GPU/TPU, the padded one on XLA:CPU (which has no ragged-all-to-all)."""
    if cfg.moe_ep_exchange != "auto":
        return cfg.moe_ep_exchange
    return "ragged" if on_accelerator() else "padded"


def ragged_buffer_rows(assignments: int, ep: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """Rows of one device's ragged receive buffer: the worst case `ep x tokens x min(k, E/ep)`
    (= assignments x min(ep, E/k)) when capacity_factor is 0, else ceil(capacity_factor x
    assignments) capped at it. `assignments` = the device's tokens x k (the balanced share)."""
    tokens = assignments // k
    worst = ep * tokens * min(k, num_experts // ep)
    if capacity_factor <= 0:
        return max(worst, 1)
    return max(1, min(worst, math.ceil(capacity_factor * assignments)))


class ExchangePlan(NamedTuple):
    """One device's view of a ragged exchange (int32 throughout; ep = expert-axis size, R = the
    receive buffer's rows). Dispatch: `ragged_all_to_all(rows, zeros[R], send_offsets, send_sizes,
    dest_offsets, recv_sizes)`; combine, the inverse: `ragged_all_to_all(out, zeros[a],
    recv_offsets, recv_sizes, back_offsets, send_sizes)`."""

    send_offsets: jax.Array  # [ep] where the rows for destination j start in my expert-sorted rows
    send_sizes: jax.Array  # [ep] rows I send to destination j (after the bound)
    dest_offsets: jax.Array  # [ep] where they land in j's receive buffer
    recv_offsets: jax.Array  # [ep] where source j's rows land in my receive buffer
    recv_sizes: jax.Array  # [ep] rows I receive from source j
    back_offsets: jax.Array  # [ep] where my results for source j go back in j's sorted rows
    recv_expert: jax.Array  # [R] local expert of each receive-buffer row; e_local = empty row
    dropped: jax.Array  # [] my assignments the bound refused
    sent_off_device: jax.Array  # [] rows I send to other devices


def ragged_plan(counts: jax.Array, me: jax.Array, rows: int) -> ExchangePlan:
    """The ragged exchange's offsets and sizes for device `me`, from every device's per-expert
    assignment counts. counts: int32[ep (source), E] (an all_gather of each device's counts; the
    experts of device j are j*E/ep .. (j+1)*E/ep - 1); me: int32[] this device's index on the
    expert axis; rows: the receive buffer's rows R. Every device computes the same matrices, so
    senders and receivers agree on where each slice goes without a further exchange."""
    ep, e = counts.shape
    e_local = e // ep
    counts = counts.astype(jnp.int32)
    per_dest = reduce(counts, "source (dest local) -> source dest", "sum", dest=ep)  # expert = (dest, local)
    # receiver d packs its sources in order; source s's slice starts after sources < s, clipped
    start = jnp.cumsum(per_dest, axis=0) - per_dest
    off = jnp.minimum(start, rows)
    kept = jnp.minimum(per_dest, rows - off)  # [source, destination], a prefix of each slice
    send_start = jnp.cumsum(per_dest, axis=1) - per_dest  # [source, destination] in the source's rows
    # the receive buffer holds (source, local expert) segments in that order (each source's rows
    # are sorted by expert, and only a prefix of them is kept); a row's segment is the first whose
    # end lies past it: a searchsorted over E segment ends, not a comparison with every row
    kept_me, off_me = kept[:, me], off[:, me]
    mine = jax.lax.dynamic_slice_in_dim(counts, me * e_local, e_local, axis=1)  # [source, e_local]
    seg_ends = off_me[:, None] + jnp.minimum(jnp.cumsum(mine, axis=1), kept_me[:, None])
    p = jnp.arange(rows, dtype=jnp.int32)
    seg_ends = rearrange(seg_ends, "source local -> (source local)")  # the buffer's segment order
    seg = jnp.searchsorted(seg_ends, p, side="right").astype(jnp.int32)  # E = empty row
    recv_expert = jnp.where(seg < e, seg % e_local, e_local)
    not_me = jnp.arange(ep) != me
    return ExchangePlan(
        send_offsets=send_start[me],
        send_sizes=kept[me],
        dest_offsets=off[me],
        recv_offsets=off_me,
        recv_sizes=kept_me,
        back_offsets=send_start[:, me],
        recv_expert=recv_expert,
        dropped=(per_dest[me] - kept[me]).sum(),
        sent_off_device=jnp.where(not_me, kept[me], 0).sum(),
    )


def ragged_all_to_all_emulated(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    axis_name: str,
) -> jax.Array:
    """`jax.lax.ragged_all_to_all` (one slice per destination) built from a padded `all_to_all`,
    for XLA:CPU, which has no ragged-all-to-all: the same result, moving `ep x operand rows` rows.
    Slice j of operand (`input_offsets[j]`, `send_sizes[j]` rows) goes to device j, where it is
    written at the `output_offsets[j]` the sender gave; the rest of `output` is kept."""
    n = operand.shape[0]
    out_rows = output.shape[0]
    i = jnp.arange(n, dtype=jnp.int32)
    pick = input_offsets[:, None] + i[None, :]  # [ep, n]
    send_ok = i[None, :] < send_sizes[:, None]
    # rows not sent read the zero row appended at index n
    padded = jnp.concatenate([operand, jnp.zeros((1,) + operand.shape[1:], operand.dtype)])
    chunks = padded[jnp.where(send_ok, jnp.minimum(pick, n), n)]  # [ep, n, ...]
    got = jax.lax.all_to_all(chunks, axis_name, 0, 0)  # [ep (source), n, ...]
    where = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # my offset for each source
    dest = where[:, None] + i[None, :]
    dest = jnp.where(i[None, :] < recv_sizes[:, None], dest, out_rows)  # out of range: not written
    flat = lambda x: rearrange(x, "source n ... -> (source n) ...")
    return output.at[flat(dest)].set(flat(got), mode="drop")


def _collective(kind: str) -> Callable[..., jax.Array]:
    """The ragged all-to-all to use: the real op ("ragged") or its emulation ("ragged_emulated")."""
    return jax.lax.ragged_all_to_all if kind == "ragged" else ragged_all_to_all_emulated


def ragged_exchange(
    xs: jax.Array,
    sorted_e: jax.Array,
    compute: ExpertCompute,
    num_experts: int,
    ep: int,
    ep_axis: str,
    rows: int,
    collective: str = "ragged",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """xs: [a, d] assignments sorted by global expert, sorted_e: int32[a] their experts ->
    (ys [a, d] each assignment's expert output, zero for dropped ones; dropped int32[] assignments
    of this device the bound refused; sent int32[] rows this device sent off-device).

    rows: the receive buffer (`ragged_buffer_rows`); collective: "ragged" (the real op) or
    "ragged_emulated" (`ragged_all_to_all_emulated`, for XLA:CPU)."""
    a, d = xs.shape
    e_local = num_experts // ep
    a2a = _collective(collective)
    counts = jnp.zeros((num_experts,), jnp.int32).at[sorted_e].add(1)
    all_counts = jax.lax.all_gather(counts, ep_axis)  # [ep, E]
    plan = ragged_plan(all_counts, jax.lax.axis_index(ep_axis), rows)
    recv = a2a(
        xs,
        jnp.zeros((rows, d), xs.dtype),
        plan.send_offsets,
        plan.send_sizes,
        plan.dest_offsets,
        plan.recv_sizes,
        axis_name=ep_axis,
    )
    # rows arrive by source; the grouped matmul wants them by local expert (empty rows last)
    order = jnp.argsort(plan.recv_expert, stable=True)
    sizes = jnp.zeros((e_local + 1,), jnp.int32).at[plan.recv_expert].add(1)[:e_local]
    out = compute(recv[order], sizes)
    back = out[jnp.argsort(order)]
    ys = a2a(
        back,
        jnp.zeros((a, d), out.dtype),
        plan.recv_offsets,
        plan.recv_sizes,
        plan.back_offsets,
        plan.send_sizes,
        axis_name=ep_axis,
    )
    return ys, plan.dropped, plan.sent_off_device


def padded_exchange(
    xs: jax.Array, sorted_e: jax.Array, compute: ExpertCompute, num_experts: int, ep: int, ep_axis: str
) -> jax.Array:
    """The worst-case exchange: xs [a, d] sorted by global expert, sorted_e int32[a] -> ys [a, d].
    Each destination gets an `a`-row slot of an [ep, a, d] buffer (and the experts as int32), so
    whatever the routing nothing is dropped; the local experts run over all `ep x a` received rows."""
    a, d = xs.shape
    e_local = num_experts // ep
    shard = sorted_e // e_local
    shard_counts = jnp.zeros((ep,), jnp.int32).at[shard].add(1)
    rank = jnp.arange(a, dtype=jnp.int32) - (jnp.cumsum(shard_counts) - shard_counts)[shard]
    send_x = jnp.zeros((ep, a, d), xs.dtype).at[shard, rank].set(xs)
    send_e = jnp.full((ep, a), e_local, jnp.int32).at[shard, rank].set(sorted_e % e_local)
    by_source = lambda x: rearrange(jax.lax.all_to_all(x, ep_axis, 0, 0), "source a ... -> (source a) ...")
    recv_x, recv_e = by_source(send_x), by_source(send_e)
    r_order = jnp.argsort(recv_e, stable=True)  # the invalid marker e_local sorts last
    r_sizes = jnp.zeros((e_local + 1,), jnp.int32).at[recv_e].add(1)[:e_local]
    r_y = compute(recv_x[r_order], r_sizes)
    back = rearrange(jnp.zeros_like(r_y).at[r_order].set(r_y), "(source a) d -> source a d", source=ep)
    ret = jax.lax.all_to_all(back, ep_axis, 0, 0)
    return ret[shard, rank]


# --------------------------------------------------------------------------------------------------
# Communication volume
# --------------------------------------------------------------------------------------------------


def exchanges_per_step(remat: str) -> int:
    """All-to-all exchanges of each assignment row per MoE layer per training step: dispatch and
    combine forward, their transposes backward, and the forward's again when the layer is
    recomputed (jax.checkpoint reruns the whole body, collectives included)."""
    return 2 * (2 + (remat != "none"))


def exchange_traffic(
    hidden: int,
    itemsize: int,
    num_experts: int,
    k: int,
    ep: int,
    tokens: int,
    capacity_factor: float = 0.0,
) -> dict[str, dict[str, float]]:
    """Bytes one device sends off-device in ONE exchange (dispatch or combine) of one MoE layer,
    for `tokens` local tokens, by strategy: `rows` (hidden vectors; `bytes` = rows x hidden x
    itemsize) and `metadata_bytes` (padded: the int32 expert ids beside the rows; ragged: the
    all_gather of int32 counts, ep x E), plus the receive buffer's rows. The ragged rows are the
    expectation under uniform routing, (ep - 1) / ep of the assignments (an assignment stays on its
    device with probability 1/ep); `rows_max` is the most it can be (every assignment off-device)."""
    a = tokens * k
    row = hidden * itemsize
    padded_rows = (ep - 1) * a
    ragged_rows = a * (ep - 1) / ep
    return {
        "padded": {
            "rows": padded_rows,
            "rows_max": padded_rows,
            "bytes": padded_rows * row,
            "metadata_bytes": padded_rows * 4,
            "receive_rows": ep * a,
        },
        "ragged": {
            "rows": ragged_rows,
            "rows_max": a if ep > 1 else 0,
            "bytes": ragged_rows * row,
            "metadata_bytes": (ep - 1) * num_experts * 4,
            "receive_rows": ragged_buffer_rows(a, ep, num_experts, k, capacity_factor) if ep > 1 else 0,
        },
    }
