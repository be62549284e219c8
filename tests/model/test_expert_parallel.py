"""Expert parallelism's two exchanges on the fake 8-device mesh: the ragged path's bookkeeping
(`ragged_plan`) against a numpy loop, its collective emulation against the documented semantics of
`jax.lax.ragged_all_to_all`, and the whole ragged layer against the padded reference (forward and
gradients) on random, skewed (every token to one device's experts: the bound's worst case) and
empty-group routing, with the overflow policy's counter and outputs against numpy."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support.moe_cases import moe_cfg as _cfg
from support.moe_cases import moe_params as _moe_params
from support.moe_cases import numpy_moe as _numpy_moe

import composer_jax as cj
from composer_jax.config import ConfigError, validate_model
from composer_jax.model.moe import expert_parallel as xp
from composer_jax.model.moe import layer, router
from composer_jax.sharding import MeshRules, ShardingRules

EP, FSDP = 4, 2  # 8 experts, 2 per device; two groups of 4 devices exchange independently


def _numpy_plan(counts: np.ndarray, rows: int):
    """For every receiver, fill its buffer source by source, each source's rows in expert order,
    until `rows`: -> kept[source, dest], and per receiver the (source, local expert) of each row."""
    ep, e = counts.shape
    el = e // ep
    kept = np.zeros((ep, ep), np.int64)
    layout = []
    for d in range(ep):
        buf: list[tuple[int, int]] = []
        for s in range(ep):
            for le in range(el):
                for _ in range(counts[s, d * el + le]):
                    if len(buf) < rows:
                        buf.append((s, le))
                        kept[s, d] += 1
        layout.append(buf)
    return kept, layout


@pytest.mark.parametrize("rows", [3, 7, 40])
def test_ragged_plan_matches_a_numpy_loop(rows):
    """Offsets, sizes and the row layout of every receiver, with empty experts, an empty source
    and (rows 3, 7) receivers that overflow."""
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 4, (EP, 8))
    counts[1] = 0  # source 1 routes nothing
    counts[:, 4] = 0  # expert 4 gets nothing
    counts[2, 6] = 9  # a hot expert on device 3
    kept, layout = _numpy_plan(counts, rows)
    per_dest = counts.reshape(EP, EP, 2).sum(-1)
    for me in range(EP):
        plan = jax.tree.map(np.asarray, xp.ragged_plan(jnp.asarray(counts), jnp.int32(me), rows))
        np.testing.assert_array_equal(plan.send_sizes, kept[me])
        np.testing.assert_array_equal(plan.recv_sizes, kept[:, me])
        np.testing.assert_array_equal(plan.send_offsets, np.concatenate([[0], np.cumsum(per_dest[me])[:-1]]))
        # results for source s go back where s's rows for me started in its sorted rows
        np.testing.assert_array_equal(plan.back_offsets, [per_dest[s, :me].sum() for s in range(EP)])
        # receiver me's buffer: source s's kept rows start where sources < s end
        np.testing.assert_array_equal(plan.recv_offsets, np.concatenate([[0], np.cumsum(kept[:, me])[:-1]]))
        for d in range(EP):
            assert plan.dest_offsets[d] == kept[:me, d].sum()
        expect = [le for _, le in layout[me]] + [2] * (rows - len(layout[me]))
        np.testing.assert_array_equal(plan.recv_expert, expect)
        assert plan.dropped == per_dest[me].sum() - kept[me].sum()
        assert plan.sent_off_device == kept[me].sum() - kept[me, me]


def test_emulated_collective_follows_the_documented_semantics():
    """The example of `jax.lax.ragged_all_to_all`'s docstring (axis of size 2), run with the
    padded-all_to_all emulation: results [1, 3, 0, 0] and [2, 2, 4, 0]."""
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,))
    operand = jnp.array([[1, 2, 2], [3, 4, 0]], jnp.float32)
    output = jnp.zeros((2, 4), jnp.float32)
    args = [jnp.array(v, jnp.int32) for v in ([[0, 1], [0, 1]], [[1, 2], [1, 1]], [[0, 0], [1, 2]], [[1, 1], [2, 1]])]

    def body(o, out, io, ss, oo, rs):
        return xp.ragged_all_to_all_emulated(o[0], out[0], io[0], ss[0], oo[0], rs[0], axis_name="x")[None]

    spec = P("x")
    f = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec)
    np.testing.assert_array_equal(np.asarray(f(operand, output, *args)), [[1, 3, 0, 0], [2, 2, 4, 0]])


def test_buffer_rows_worst_case_and_capacity_factor():
    # worst case a x min(ep, E/k): EP 8, 384 experts, k 8 (Kimi): 8 x; EP 128 with 256 experts, k 8
    # (MaxText's example): 32 x; capacity factor 1.5 of 100 assignments: 150 rows
    assert xp.ragged_buffer_rows(2048 * 8, 8, 384, 8, 0.0) == 8 * 2048 * 8
    assert xp.ragged_buffer_rows(100 * 8, 128, 256, 8, 0.0) == 32 * 100 * 8
    assert xp.ragged_buffer_rows(100, 4, 8, 2, 1.5) == 150
    assert xp.ragged_buffer_rows(100, 4, 8, 2, 100.0) == 4 * 100  # capped at the worst case


def _setup(exchange, capacity=0.0, seq=6):
    cfg = _cfg(moe_impl="tiled", moe_tile_size=8, moe_ep_exchange=exchange, moe_ep_capacity_factor=capacity)
    p = _moe_params(cfg, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8, seq, cfg.hidden_size))
    mesh = cj.make_mesh(cj.MeshConfig(data=1, fsdp=FSDP, expert=EP, context=1, tensor=1))
    sh = MeshRules(mesh, ShardingRules.create())
    # rows of the batch are split over (fsdp, expert) (data is 1): row r sits on expert index r % EP
    assert sh.spec(("act_batch", "act_seq", None), x.shape)[0] == ("fsdp", "expert")
    return cfg, p, x, sh


def _routing(kind, seq=6):
    if kind == "random":
        return None
    if kind == "one_device":  # every token to experts 0 and 1, both on expert-axis device 0
        return jnp.broadcast_to(jnp.array([1, 0], jnp.int32), (8, seq, 2))
    # empty groups: only experts 2, 5, 7 are ever chosen
    rng = np.random.default_rng(1)
    pairs = np.array([[2, 5], [7, 2], [5, 7]])
    return jnp.asarray(pairs[rng.integers(0, 3, (8, seq))], jnp.int32)


def _run(cfg, p, x, sh, replay):
    def loss(p, x):
        y, _, stats = layer.moe_layer(p, x, cfg, sh, replay)
        return jnp.sum(jnp.sin(y)), (y, stats)

    (_, (y, stats)), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(p, x)
    return y, stats, g


@pytest.mark.parametrize("routing", ["random", "one_device", "empty_groups"])
def test_ragged_equals_padded_forward_and_gradients(routing):
    """With the worst-case bound the ragged exchange is dropless: the same rows reach the same
    experts, so outputs and gradients equal the padded reference's, and it moves fewer rows."""
    cfg, p, x, sh = _setup("padded")
    replay = _routing(routing)
    y_ref, s_ref, g_ref = _run(cfg, p, x, sh, replay)
    y, s, g = _run(dataclasses.replace(cfg, moe_ep_exchange="ragged_emulated"), p, x, sh, replay)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=1e-5)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert float(s["moe_dropped"]) == float(s_ref["moe_dropped"]) == 0.0
    a = 6 * 2  # assignments per device
    assert float(s_ref["moe_a2a_rows"]) == (EP - 1) * a
    # ragged: the rows routed off-device (one_device: devices 1..3 send everything, device 0 nothing)
    r = np.asarray(router.route(p["router"], p["router_bias"], x.reshape(-1, 16), cfg).experts).reshape(8, 6, 2)
    experts = r if replay is None else np.asarray(replay)
    off = sum(int((experts[row] // 2 != row % EP).sum()) for row in range(8)) / 8
    assert float(s["moe_a2a_rows"]) == off
    # the padded reference against numpy too (the layer's own reference, independent of both paths)
    w = np.asarray(
        router.route(
            p["router"], p["router_bias"], x.reshape(-1, 16), cfg, None if replay is None else replay.reshape(-1, 2)
        ).weights
    )
    ref = _numpy_moe(jax.tree.map(np.asarray, p), np.asarray(x).reshape(-1, 16), cfg, experts.reshape(-1, 2), w)
    np.testing.assert_allclose(np.asarray(y_ref).reshape(-1, 16), ref, atol=1e-5)


def _expected_drops(experts: np.ndarray, rows: int):
    """Which assignments the bound refuses, from the policy as stated: per group of EP devices
    (rows g*EP .. g*EP+3 of the batch), each receiver takes its sources in device order and each
    source's rows in (expert, token, slot) order, up to `rows`. -> bool[batch, seq, k]."""
    drop = np.zeros(experts.shape, bool)
    for g in range(FSDP):
        for d in range(EP):
            taken = 0
            for s in range(EP):
                e = experts[g * EP + s].reshape(-1)
                for i in sorted(np.flatnonzero(e // 2 == d), key=lambda i: (e[i], i)):
                    if taken < rows:
                        taken += 1
                    else:
                        drop[g * EP + s].reshape(-1)[i] = True
    return drop


@pytest.mark.parametrize("routing,capacity", [("one_device", 1.0), ("random", 1.0), ("one_device", 2.5)])
def test_overflow_is_dropped_and_counted(routing, capacity):
    """A capacity factor below the worst case: the assignments past each receiver's bound give
    zero expert output and are counted; the layer equals numpy with exactly those dropped."""
    cfg, p, x, sh = _setup("ragged_emulated", capacity)
    replay = _routing(routing)
    y, stats, _ = _run(cfg, p, x, sh, replay)
    r = router.route(
        p["router"], p["router_bias"], x.reshape(-1, 16), cfg, None if replay is None else replay.reshape(-1, 2)
    )
    experts = np.asarray(r.experts).reshape(8, 6, 2)
    rows = xp.ragged_buffer_rows(12, EP, 8, 2, capacity)
    drop = _expected_drops(experts, rows)
    if routing == "one_device":
        # hand-worked: device 0 of each group is offered 4 x 12 = 48 rows and keeps `rows`
        assert drop.sum() == FSDP * (48 - rows)
    assert float(stats["moe_dropped"]) == drop.sum() > 0
    w = np.where(drop.reshape(-1, 2), 0.0, np.asarray(r.weights))
    ref = _numpy_moe(jax.tree.map(np.asarray, p), np.asarray(x).reshape(-1, 16), cfg, experts.reshape(-1, 2), w)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 16), ref, atol=1e-5)


def test_forward_reports_dropped_assignments_per_layer():
    """`moe_dropped` reaches the model's aux (per MoE layer) through forward: every token routed
    to one device's experts with capacity 1.0 drops a known number per layer."""
    cfg = cj.load_config(Path(__file__).resolve().parents[2] / "configs/model/tiny.yaml")
    m = dataclasses.replace(cfg.model, moe_ep_exchange="ragged_emulated", moe_ep_capacity_factor=1.0, num_mtp_layers=0)
    params = cj.init_params(m, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 6), 0, m.vocab_size)
    mesh = cj.make_mesh(cj.MeshConfig(data=1, fsdp=FSDP, expert=EP, context=1, tensor=1))
    k = m.num_experts_per_tok
    e_local = m.num_experts // EP
    routing = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32) % e_local, (m.num_moe_layers, 8, 6, k))
    with jax.set_mesh(mesh):
        out = jax.jit(lambda p, t: cj.forward(p, t, m, routing=routing))(params, tokens)
    a = 6 * k
    rows = xp.ragged_buffer_rows(a, EP, m.num_experts, k, 1.0)
    np.testing.assert_array_equal(np.asarray(out.aux["moe_dropped"]), [FSDP * (EP * a - rows)] * m.num_moe_layers)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_capacity_factor_validation_names_the_value(bad):
    m = dataclasses.replace(_cfg(), moe_ep_capacity_factor=bad)
    with pytest.raises(ConfigError, match=r"moe_ep_capacity_factor=.*accepted: 0"):
        validate_model(m)


def test_exchange_traffic_ratio_is_ep():
    t = xp.exchange_traffic(hidden=7168, itemsize=2, num_experts=384, k=8, ep=8, tokens=2048)
    a = 2048 * 8
    assert t["padded"]["bytes"] == 7 * a * 7168 * 2
    assert t["ragged"]["bytes"] == a * 7 / 8 * 7168 * 2
    assert t["padded"]["bytes"] / t["ragged"]["bytes"] == 8
    assert xp.exchanges_per_step("full") == 6 and xp.exchanges_per_step("none") == 4


@pytest.mark.slow  # compiles a whole train step (~90 s on 2 cores)
def test_train_step_logs_dropped_assignments_and_exchange_bytes():
    """The step's metrics: every token forced onto device 0's experts (router bias +100 on
    experts 0 and 1, k = 2) with capacity 2.5. Hand-worked per MoE layer and group of 4 devices:
    each device has 32 tokens x 2 = 64 assignments, receiver 0 is offered 4 x 64 = 256 rows and
    keeps R = 160: source 0's 64 (local), source 1's 64, 32 of source 2's, none of source 3's. So
    96 dropped per group, 2 groups x 2 MoE layers = 384 per step; 96 rows sent off-device per
    group = 24 per device per layer, 48 per step, each sent 4 times (dispatch, combine, forward
    and backward; remat none) as 64 float32 values: 48 x 64 x 4 bytes x 4 = 49,152 bytes."""
    from composer_jax.model.params import router_biases, with_router_biases
    from composer_jax.train.state import init_train_state
    from composer_jax.train.step import make_train_step

    tiny = Path(__file__).resolve().parents[2] / "configs/model/tiny.yaml"
    overrides = [
        "model.num_mtp_layers=0",
        "model.moe_ep_exchange=ragged_emulated",
        "model.moe_ep_capacity_factor=2.5",
        "model.remat=none",
        "train.batch_size=8",
        "train.seq_len=32",
        "train.router_bias_update=false",
        f"mesh.fsdp={FSDP}",
        f"mesh.expert={EP}",
        "mesh.data=1",
    ]
    cfg = cj.load_config(tiny, overrides, num_devices=8)
    mesh = cj.make_mesh(cfg.mesh)
    rules = cj.ShardingRules.create()
    state = init_train_state(cfg, mesh, rules)
    biases = {k: b.at[..., :2].add(100.0) for k, b in router_biases(state.params).items()}
    state = dataclasses.replace(state, params=with_router_biases(state.params, biases))
    rng = np.random.default_rng(0)
    batch = {
        "tokens": rng.integers(1, 512, (8, 32)).astype(np.int32),
        "segment_ids": np.ones((8, 32), np.int32),
        "positions": np.tile(np.arange(32, dtype=np.int32), (8, 1)),
        "loss_mask": np.ones((8, 32), np.float32),
    }
    with jax.set_mesh(mesh):
        _, metrics = make_train_step(cfg, mesh, rules, donate=False)(state, batch)
    assert cfg.model.num_moe_layers == 2 and cfg.model.hidden_size == 64
    assert float(metrics["moe_dropped"]) == 384
    assert float(metrics["moe_a2a_bytes_per_device"]) == 48 * 64 * 4 * 4
