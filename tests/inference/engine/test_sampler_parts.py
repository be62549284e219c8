"""The sampler's parts alone, without a model: `PrefixCache` (slot choice, matches, counters, weight
swaps), `SlotTable` (recording emitted tokens, stops, completions, what a freed slot leaves),
`CountedJit` (compilations counted per program, per thread) and the draft-vocabulary check."""

from __future__ import annotations

import threading

import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.inference.engine.counted_jit import CountedJit
from composer_jax.inference.engine.prefix_cache import PrefixCache, PrefixStats
from composer_jax.inference.engine.slot_table import Request, SlotTable
from composer_jax.inference.engine.speculative_decoder import checked_draft_vocab
from composer_jax.inference.engine.token_sampling import SamplingParams


def _routing(n: int, tag: int) -> list[np.ndarray]:
    return [np.full((2, 1), 100 * tag + t, np.int32) for t in range(n)]


# ------------------------------------------------------------------------------- PrefixCache
def test_prefix_matches_slot_choice_and_counters_by_hand():
    pc = PrefixCache(3)
    # nothing cached: every slot matches 0; the least recently used (never used: -1, lowest index first)
    assert pc.best_slot([0, 1, 2], [5, 6, 7]) == (0, 0)
    assert pc.take(0, 3, 0) == []
    pc.release(0, [5, 6, 7, 8, 9], _routing(5, 0), pc.generation)
    assert pc.best_slot([1, 2], [1, 2]) == (1, 0)
    pc.take(1, 2, 0)
    pc.release(1, [5, 6, 1], _routing(3, 1), pc.generation)
    # slot 0 holds 5 6 7 8 9, slot 1 holds 5 6 1, slot 2 nothing
    prompt = np.asarray([5, 6, 7, 4, 4], np.int32)
    assert [pc.match(i, prompt) for i in range(3)] == [3, 2, 0]
    # at most all but the prompt's last token: a prefill needs one token
    assert pc.match(0, np.asarray([5, 6, 7, 8, 9], np.int32)) == 4
    assert pc.best_slot([0, 1, 2], prompt) == (0, 3)
    routing = pc.take(0, 5, 3)
    assert [int(r[0, 0]) for r in routing] == [0, 1, 2] and pc.prefixes[0] is None
    # equal matches: the least recently used slot (2 was never used; 1 left at the clock's 4th tick)
    assert pc.best_slot([1, 2], [9, 9]) == (2, 0)
    assert pc.stats == PrefixStats(admitted=3, hits=1, reused=3, prefilled=3 + 2 + 2)
    assert pc.stats.as_dict()["hit_rate"] == 3 / 10
    total = pc.stats + PrefixStats(1, 1, 2, 3)
    assert (total.admitted, total.hits, total.reused, total.prefilled) == (4, 2, 5, 10)


def test_weight_changes_drop_prefixes_unless_kept_and_none_never_caches():
    version, keep, none = PrefixCache(1, "version"), PrefixCache(1, "keep"), PrefixCache(1, "none")
    for pc in (version, keep, none):
        gen = pc.generation
        pc.take(0, 4, 0)
        pc.new_weights()  # the request ran across a swap: its prefix mixes two weights
        pc.release(0, [1, 2, 3, 4], _routing(4, 0), gen)
    assert version.prefixes == [None] and none.prefixes == [None]
    assert keep.prefixes[0] is not None and keep.match(0, np.asarray([1, 2, 3, 9])) == 3
    version.take(0, 4, 0)
    version.release(0, [1, 2, 3, 4], _routing(4, 0), version.generation)  # admitted and left under one version
    assert version.match(0, np.asarray([1, 2, 3, 9])) == 3
    version.new_weights()
    assert version.prefixes == [None] and version.match(0, np.asarray([1, 2, 3, 9])) == 0
    assert PrefixCache(1, "keep", reuse=False).reuse is False  # speculative samplers cache nothing
    with pytest.raises(ValueError, match=r"prefix_cache='on' is not accepted; accepted: none, version, keep"):
        PrefixCache(1, "on")


# ------------------------------------------------------------------------------- SlotTable
def _table(slots: int = 2, **kw) -> SlotTable:
    return SlotTable(slots, PrefixCache(slots), **kw)


def test_emitted_tokens_are_recorded_until_a_stop_and_the_rest_dropped():
    table = _table()
    table.waiting.extend(
        [
            Request([1, 2, 3], SamplingParams(max_tokens=5, stop_token_ids=(9,)), id="a"),
            Request([4], SamplingParams(max_tokens=2), id="b"),
            Request([7, 7], SamplingParams(max_tokens=2), id="c"),
        ]
    )
    placed = table.place()
    assert [(i, r.id, reuse) for i, r, reuse in placed] == [(0, "a", 0), (1, "b", 0)] and len(table.waiting) == 1
    for i, r, _ in placed:
        table.occupy(i, r, [])
    assert table.active().tolist() == [True, True] and table.busy
    # slot 0 emits 4 tokens, its stop id third: the fourth is dropped
    rows = np.arange(4 * 2).reshape(4, 2, 1)
    done = table.emit(0, np.asarray([5, 6, 9, 8]), np.asarray([-0.1, -0.2, -0.3, -0.4]), rows, 3)
    (a,) = done
    assert (a.id, a.tokens, a.logprobs, a.versions, a.finish_reason) == (
        "a",
        [5, 6, 9],
        [-0.1, -0.2, -0.3],
        [3] * 3,
        "stop",
    )
    assert a.routing is not None and a.routing.shape == (3, 2, 1) and a.routing.dtype == np.int32
    assert table.held[0] is None and table.last[0] == 9
    # the freed slot's prefix: the prompt and the tokens fed back (not the last one)
    prefix = table.prefixes.prefixes[0]
    assert prefix is not None and prefix.tokens.tolist() == [1, 2, 3, 5, 6]
    (b,) = table.emit(1, np.asarray([3, 3, 3]), np.zeros(3), None, 4)
    assert (b.tokens, b.finish_reason, b.routing) == ([3, 3], "length", None)
    assert table.busy and not table.active().any()  # c waits


def test_stop_strings_settings_limits_running_and_cancel():
    table = _table(detokenize=lambda ids: "".join(chr(96 + t) for t in ids))
    table.occupy(0, Request([1], SamplingParams(max_tokens=9, stop_strings=("bc",)), id="s"), [])
    table.occupy(
        1, Request([1], SamplingParams(temperature=0.5, max_tokens=4, stop_token_ids=tuple(range(20))), id="t"), []
    )
    assert table.record(0, 2, 0.0, 0) == []
    (s,) = table.record(0, 3, 0.0, 0)  # "bc"
    assert s.finish_reason == "stop" and s.tokens == [2, 3]
    temperature, top_k, top_p, seed, occupied = table.settings()
    np.testing.assert_allclose(np.asarray(temperature), [1.0, 0.5])  # the free slot: the defaults
    assert np.asarray(occupied).tolist() == [False, True]
    remaining, stop_ids = table.on_device_limits(table.active())
    assert remaining.tolist() == [0, 4] and stop_ids[1].tolist() == list(range(8)) and stop_ids[0].tolist() == [-1] * 8
    assert table.running() == {"t": ([], [], [])}
    assert table.cancel("t") and not table.cancel("t") and not table.busy


# ------------------------------------------------------------------------------- CountedJit
def test_compilations_are_counted_per_program_new_shape_and_thread():
    f, g = CountedJit(lambda x: x * 2), CountedJit(lambda x: x + 1)
    f(jnp.zeros(3))
    f(jnp.ones(3))  # the same shape: no compilation
    assert f.compilations == 1
    f(jnp.zeros(5))
    assert f.compilations == 2 and g.compilations == 0
    g(jnp.zeros(3))  # another program of the same shape compiles on its own
    assert g.compilations == 1
    jnp.sin(jnp.zeros(7)).block_until_ready()  # a compilation outside any program: counted nowhere
    assert (f.compilations, g.compilations) == (2, 1)
    threads = [threading.Thread(target=lambda n=n: f(jnp.zeros(10 + n))) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert f.compilations == 5 and g.compilations == 1


def test_draft_vocab_check():
    np.testing.assert_array_equal(checked_draft_vocab([5, 1, 5, 3], 8), [1, 3, 5])
    assert checked_draft_vocab(None, 8) is None
    with pytest.raises(ValueError, match=r"draft_vocab: 2 ids from \[1\] to \[8\]; give at least one id, all in 0..7"):
        checked_draft_vocab([1, 8], 8)
