"""Every notebook in notebooks/ runs top to bottom (code cells executed in order, one namespace), and
what it computes and prints matches numbers worked out independently of the code under test."""

import contextlib
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support.bwrap import require_bwrap

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


def _check_02_rl_objective(ns: dict, printed: str) -> None:
    # Dr. GRPO: A = [1, 0, 0, 1] - 0.5 and [1, 1, 0] - 2/3; GRPO divides by the sample std 0.57735
    np.testing.assert_allclose(ns["adv_dr"], [0.5, -0.5, -0.5, 0.5, 1 / 3, 1 / 3, -2 / 3], atol=1e-12)
    std = math.sqrt(1 / 3) + 1e-6
    np.testing.assert_allclose(ns["adv_grpo"], np.array([0.5, -0.5, -0.5, 0.5, 1 / 3, 1 / 3, -2 / 3]) / std)
    # kept pg terms 0.6 + 0.5 - 0.5 - 0.4 - 0.625 - 0.45 = -0.875 (row 0's r = 3 filtered):
    # token_sum 0.875 / 10; token_mean 0.875 / 7; sequence_mean -(1.1 / 3 - 1.975 / 4) / 2
    losses = ns["losses"]
    assert abs(losses["token_sum"] - 0.0875) < 1e-7
    assert abs(losses["token_mean"] - 0.125) < 1e-7
    assert abs(losses["sequence_mean"] - (-(1.1 / 3 - 1.975 / 4) / 2)) < 1e-7
    assert "token_sum      loss = 0.875000 / 10 = 0.087500" in printed
    assert abs(ns["filtered"] - 1 / 7) < 1e-7 and abs(ns["clip_fraction"] - 1 / 3) < 1e-7
    k1 = -(math.log(1.5) + math.log(3) + math.log(0.5) + math.log(1.25) + math.log(0.9)) / 7
    assert abs(ns["mismatch_k1"] - k1) < 1e-6
    # d loss / d logp = -r A / 10 inside the clip range, 0 on clipped / filtered / prompt tokens
    np.testing.assert_allclose(ns["grad"], [[0, 0, -0.05, 0, 0], [0, 0.05, 0, 0.0625, 0.045]], atol=1e-7)
    # C_{0.01,q}(100): q = 0 -> 100; 0.5 -> (sqrt 2 - 1) / 0.005; 1 -> ln 2 / 0.01; 2 -> 0.5 / 0.01
    curve = ns["curve"]
    np.testing.assert_allclose(
        [curve[0.0][2], curve[0.5][2], curve[1.0][2], curve[2.0][2]],
        [100.0, (math.sqrt(2) - 1) / 0.005, math.log(2) / 0.01, 50.0],
        rtol=1e-12,
    )
    # continuity through q = 1: the first-order term a L^2 / (2k) = 1e-9 * ln(2)^2 / 0.02 = 2.4e-8
    np.testing.assert_allclose(ns["near"], [math.log(2) / 0.01] * 3, rtol=1e-9)
    # 1 - 0.3 * 4/3 - 0.2 - 0.1 + 0.1
    assert abs(ns["breakdown"].total - 0.4) < 1e-12
    assert "length_penalty     -0.4000" in printed


def _check_03_one_rollout(ns: dict, printed: str) -> None:
    if not ns["sandbox"]:
        assert "bubblewrap sandbox available: False" in printed
        require_bwrap("bubblewrap (bwrap) is not installed: the notebook's rollouts did not run")
    # the random model: one turn of max_turn_tokens=24 without its stop token (finish "length"),
    # every generated token recorded with a log-probability, version 0 and top-2 experts
    r = ns["random_rollout"]
    gen = r.generations[0]
    mask = np.asarray(gen.loss_mask)
    if r.finish_reason == "length":
        assert mask.sum() == 24 == gen.generated
    assert mask.sum() == gen.generated and len(gen.tokens) == len(gen.logprobs) == len(gen.versions)
    lp = np.asarray(gen.logprobs)[mask == 1]
    assert np.all(lp <= 0) and np.all(np.isfinite(lp))
    assert set(np.asarray(gen.versions)[mask == 1]) == {0} and gen.routing.shape == (len(gen.tokens), 1, 2)
    # the scripted rollout: turn 1 = list_dir + grep (valid, run together) + an unknown tool; turn 2 answers
    s = ns["rollout"]
    roles = [m["role"] for m in s.generations[0].messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "tool", "assistant"]
    assert (s.finish_reason, s.turns, s.tool_calls, s.broken_tool_calls, s.parallel_tool_turns) == (
        "answer",
        2,
        3,
        1,
        1,
    )
    assert "unknown tool 'read_fil'" in s.generations[0].messages[5]["content"]
    # reward: grade 0; length penalty 0.1 * log(1 + 0.5 * 2) / 0.5 = 0.138629 (q = 1, x = 2 turns);
    # one broken call at 0.05
    b = ns["breakdown"]
    assert b.grade == 0.0 and abs(b.length_penalty + 0.1 * math.log(2.0) / 0.5) < 1e-9
    assert b.broken_tool_calls == -0.05 and abs(b.total - (-0.1 * math.log(2.0) / 0.5 - 0.05)) < 1e-9
    assert "length_penalty     -0.1386" in printed


def _mx_by_hand(b: np.ndarray, dtype, emax: int, elem_max: float, rule: str) -> np.ndarray:
    """MX quantise-dequantise of [n, 32] blocks with numpy and ml_dtypes: scale 2^(floor(log2 amax) -
    emax) saturating (OCP MX v1.0), or 2^ceil(log2(amax / elem_max)) (round-up)."""
    amax = np.abs(b).max(axis=1, keepdims=True)
    if rule == "ocp":
        scale = np.exp2(np.floor(np.log2(amax)) - emax)
    else:
        scale = np.exp2(np.ceil(np.log2(amax / elem_max)))
    return np.clip(b / scale, -elem_max, elem_max).astype(dtype).astype(np.float64) * scale


def _check_04_quantisation(ns: dict, printed: str) -> None:
    import ml_dtypes

    errors, acts = ns["errors"], ns["acts"]
    assert list(acts) == ["hidden [256, 64]", "expert SwiGLU [256, 32]", "gate weight^T [32, 64]"]
    # the notebook's numbers against an independent quantiser (numpy + ml_dtypes rounding)
    for name, a in acts.items():
        b = np.asarray(a, np.float64).reshape(-1, 32)  # 32-element blocks along each row
        j = list(acts).index(name)
        for fmt, dtype, emax, elem_max in (
            ("mxfp8_e4m3", ml_dtypes.float8_e4m3fn, 8, 448.0),
            ("mxfp8_e5m2", ml_dtypes.float8_e5m2, 15, 57344.0),
        ):
            for rule in ("ocp", "ceil"):
                q = _mx_by_hand(b, dtype, emax, elem_max, rule)
                ref = np.linalg.norm(q - b) / np.linalg.norm(b)
                np.testing.assert_allclose(errors[fmt, rule][j], ref, rtol=1e-4, err_msg=f"{fmt} {rule} {name}")
    # what the markdown says of the table
    for j in range(3):
        e4, e5 = errors["mxfp8_e4m3", "ceil"][j], errors["mxfp8_e5m2", "ceil"][j]
        nv, mx4 = errors["nvfp4", "second: token"][j], errors["mxfp4", "ocp"][j]
        assert 1.6 < e5 / e4 < 2.4 and e5 < nv < mx4 and 3 < nv / e4 and mx4 / e4 < 5.5
        assert abs(errors["nvfp4", "second: token"][j] / errors["nvfp4", "second: tensor"][j] - 1) < 0.1
        assert errors["mxfp8_e4m3", "ocp"][j] > e4  # saturation costs more than the lost binade here
    assert "mxfp8_e4m3   ceil" in printed
    # the leak: per tensor token 0's output moves, per token it is bit-identical
    assert ns["leak"]["tensor"] > 1e-3 and ns["leak"]["token"] == 0.0
    assert "per token: token 0's output moved by max |dy| = 0 " in printed


def _check_01_pictures(ns: dict) -> None:
    # the expert-load figure: one panel per MoE layer, its bars the load table's rows
    load = ns["load"]
    axes = ns["fig"].axes
    assert len(axes) == load.shape[0]
    for layer, ax in enumerate(axes):
        np.testing.assert_array_equal([p.get_height() for p in ax.patches], load[layer])
    # the parameter table: every leaf once, with the sharding the forward pass ran under
    rows = {name: rest for name, *rest in ns["rows"]}
    assert len(rows) == len(ns["jax"].tree.leaves(ns["params"]))
    assert rows["moe_layers/moe/gate"] == [(2, 8, 64, 32), "float32", str(P(None, "expert", "fsdp", None))]


def _check_04_pictures(ns: dict) -> None:
    # the bar chart shows the table: one bar series per scheme, one bar per tensor
    bars, errors = ns["bars"], ns["errors"]
    assert list(bars) == [f"{fmt} ({rule})" for fmt, rule in errors]
    for (fmt, rule), row in errors.items():
        np.testing.assert_allclose(bars[f"{fmt} ({rule})"], row, rtol=1e-12)


# a run directory as the trainers write it (train/observe.py's RunLogger): a pretraining stage with
# expert counts and an RL stage with two held-out evaluations
RUN_LOSS = [(1, 5.0), (2, 4.0), (3, 4.5), (4, 3.0)]
RUN_COUNTS = {1: [[10, 30], [20, 20]], 4: [[15, 25], [30, 10]]}
RUN_REWARD = [(1, 0.3), (2, 0.1), (3, 0.2), (4, 0.4), (5, 0.35), (6, 0.15), (7, 0.5), (8, 0.2)]


def _setup_05_run_at_a_glance(tmp_path: Path, monkeypatch) -> None:
    from composer_jax.train.observe import RunLogger

    run = tmp_path / "run"
    log = RunLogger(run / "stage1", "stage1", tensorboard=False)
    for step, loss in RUN_LOSS:
        log.log(step, {"loss": loss}, {"expert_counts": RUN_COUNTS[step]} if step in RUN_COUNTS else None)
    log.log(4, {"eval/perplexity": 30.0})
    log.close()
    log = RunLogger(run / "rl", "rl", tensorboard=False)
    log.log(0, {"eval/pass@1": 0.25})
    for step, r in RUN_REWARD:
        log.log(step, {"reward/total": r, "rollout/success": r / 2})
    log.log(8, {"eval/pass@1": 0.375, "eval/paired_diff": 0.125, "eval/paired_se": 0.05})
    log.close()
    monkeypatch.setenv("COMPOSER_JAX_RUN", str(run))


def _check_05_run_at_a_glance(ns: dict, printed: str) -> None:
    assert "stages: stage1 (pretraining), rl (RL)" in printed
    # loss 5, 4, 4.5, 3 at steps 1-4: mean step 2.5, mean loss 4.125, Sxx 5, Sxy -2.75 -> slope -0.55
    t = ns["trends"]["stage1"]
    assert abs(t.slope + 0.55) < 1e-12 and t.n == 4
    assert "stage1       train loss slope -0.550 +- " in printed
    # expert load max/mean at the last logged step (4): layer 0 25 / 20, layer 1 30 / 20
    assert "stage1       step 4: max/mean per layer [1.25 1.5 ]" in printed
    np.testing.assert_array_equal(ns["loads"]["stage1"][1], RUN_COUNTS[1])
    # the RL trends against numpy's own least-squares fit
    xs, ys = np.array(RUN_REWARD).T
    for key, scale in (("reward/total", 1.0), ("rollout/success", 0.5)):
        slope = np.polyfit(xs, ys * scale, 1)[0]
        assert abs(ns["rl_trends"]["rl", key].slope - slope) < 1e-12
    assert "rl held-out pass@1 paired change at step 8: +0.125 (se 0.050)" in printed


def _check_01(ns: dict, printed: str) -> None:
    _check_01_model_tour(ns, printed)
    _check_01_pictures(ns)


def _check_04(ns: dict, printed: str) -> None:
    _check_04_quantisation(ns, printed)
    _check_04_pictures(ns)


CHECKS = {
    "01_model_tour.ipynb": _check_01,
    "02_rl_objective.ipynb": _check_02_rl_objective,
    "03_one_rollout.ipynb": _check_03_one_rollout,
    "04_quantisation.ipynb": _check_04,
    "05_run_at_a_glance.ipynb": _check_05_run_at_a_glance,
}
# notebooks that read something a test must lay out first (here: a run directory)
SETUP = {"05_run_at_a_glance.ipynb": _setup_05_run_at_a_glance}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch, tmp_path):
    assert path.name in CHECKS, f"{path.name} has no result checks; add them to CHECKS in {Path(__file__).name}"
    monkeypatch.chdir(path.parent)
    if path.name in SETUP:
        SETUP[path.name](tmp_path, monkeypatch)
    namespace, printed = _run(path)
    CHECKS[path.name](namespace, printed)


@pytest.mark.slow
def test_run_notebook_trains_a_stage_when_there_is_no_run(monkeypatch, tmp_path):
    # no run directory: the notebook trains 6 steps of tiny stage 1 and shows that run
    monkeypatch.setenv("COMPOSER_JAX_RUN", str(tmp_path / "missing"))
    path = next(p for p in NOTEBOOKS if p.name == "05_run_at_a_glance.ipynb")
    monkeypatch.chdir(path.parent)
    ns, printed = _run(path)
    assert "stages: stage1 (pretraining)" in printed and "no RL stage" in printed
    (stage,) = ns["stages"]
    assert [s for s, _ in stage.series["loss"]] == [1, 2, 3, 4, 5, 6]
    assert ns["trends"]["stage1"].n == 6
    # each logged step's expert counts: batch 8 x seq 128 tokens, top-2, per MoE layer
    for counts in ns["loads"]["stage1"].values():
        np.testing.assert_array_equal(counts.sum(-1), [8 * 128 * 2] * counts.shape[0])
