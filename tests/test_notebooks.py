"""Every notebook in notebooks/ runs top to bottom (code cells executed in order, one namespace), and
what it computes and prints matches numbers worked out independently of the code under test."""

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def _run(path: Path) -> tuple[dict, str]:
    """(the namespace after the last cell, everything the cells printed)."""
    nb = json.loads(path.read_text())
    namespace: dict = {"__name__": "__notebook__"}
    out = io.StringIO()
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        with contextlib.redirect_stdout(out):
            exec(compile(source, f"{path.name}[cell {i}]", "exec"), namespace)
    return namespace, out.getvalue()


def _kimi_k2_params() -> tuple[int, int]:
    """(total, active) parameters of Kimi K2 (configs/model/kimi_k2.yaml) counted by hand: DeepSeek-V3
    layout, hidden d=7168, 61 layers (1 dense + 60 MoE), 64 heads, vocab 163840."""
    d, vocab, heads = 7168, 163840, 64
    # MLA: q_a [d, 1536], q_a_norm 1536, q_b [1536, 64*(128+64)], kv_a [d, 512+64], kv_a_norm 512,
    # kv_b [512, 64*(128+128)], o [64*128, d]
    attn = d * 1536 + 1536 + 1536 * heads * 192 + d * 576 + 512 + 512 * heads * 256 + heads * 128 * d
    assert attn == 101_124_096
    norms = 2 * d  # input and post-attention RMSNorm
    expert = 3 * d * 2048  # SwiGLU gate, up, down of width 2048 = 44_040_192
    router = d * 384 + 384  # gate [d, 384] and the noaux_tc score-correction bias
    dense_layer = attn + norms + 3 * d * 18432
    moe_layer = attn + norms + router + (384 + 1) * expert  # 384 routed + 1 shared
    total = 2 * vocab * d + d + dense_layer + 60 * moe_layer  # embedding, lm_head (untied), final norm
    # per token only 8 of the 384 routed experts run
    active = total - 60 * (384 - 8) * expert
    return total, active


def _check_01_model_tour(ns: dict, printed: str) -> None:
    assert "8 devices" in printed
    # Kimi K2: 1_026_408_232_448 total, 32_861_500_928 active (the model card's "1T / 32B")
    total, active = _kimi_k2_params()
    assert (ns["r"]["params"]["total"], ns["r"]["params"]["active"]) == (total, active)
    assert f"Kimi K2: {total / 1e12:.2f}T total, {active / 1e9:.1f}B active per token" in printed
    assert "Kimi K2: 1.03T total, 32.9B active per token" in printed

    # tiny: vocab 512, 3 layers of which the first is dense, top-2 of 8 experts, one MTP depth;
    # the batch is 8 rows of 32 tokens
    m = ns["cfg"].model
    assert (m.vocab_size, m.num_layers, m.first_k_dense, m.num_experts_per_tok) == (512, 3, 1, 2)
    out = ns["out"]
    assert out.logits.shape == (8, 32, 512)
    assert out.mtp_logits.shape == (1, 8, 32, 512)
    assert out.routing.shape == (2, 8, 32, 2)  # [MoE layers, batch, seq, top-k]
    assert "logits (8, 32, 512) MTP logits (1, 8, 32, 512) routing (2, 8, 32, 2)" in printed
    # stacked expert weights [layers, experts, embed, f]: experts over 'expert', embed over 'fsdp'
    assert ns["params"]["moe_layers"]["moe"]["gate"].sharding.spec == P(None, "expert", "fsdp", None)
    # each MoE layer routes 8 * 32 tokens to 2 experts each: every row of the load table sums to 512
    load = ns["load"]
    assert load.shape == (2, 8)
    np.testing.assert_array_equal(load.sum(axis=1), [512, 512])
    # replaying the routing the forward pass chose reproduces its logits exactly
    assert "max |logits - replayed logits| = 0.0" in printed
    np.testing.assert_array_equal(np.asarray(ns["again"].logits), np.asarray(out.logits))


CHECKS = {"01_model_tour.ipynb": _check_01_model_tour}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch):
    assert path.name in CHECKS, f"{path.name} has no result checks; add them to CHECKS in {Path(__file__).name}"
    monkeypatch.chdir(path.parent)
    namespace, printed = _run(path)
    CHECKS[path.name](namespace, printed)
