"""The tiny three-stage run (`composer-jax demo`) on the bundled corpus: training loss and held-out
perplexity fall in every stage; the MTP head's held-out accuracy rises in stages 2 and 3."""

import pytest


@pytest.mark.slow
def test_three_stage_pipeline(tmp_path, monkeypatch):
    from composer_jax.demo import REPO, pipeline

    monkeypatch.chdir(REPO)
    results = pipeline(str(tmp_path), scale=1.0, echo=lambda s: None, rl=False)
    assert [r["name"] for r in results] == ["stage1", "stage2", "stage3_sft"]
    for r in results:
        losses = [r["losses"][k] for k in sorted(r["losses"])]
        first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
        assert last < first, (r["name"], losses)
        assert r["evals"][-1]["eval/perplexity"] < r["evals"][0]["eval/perplexity"], (r["name"], r["evals"])
    for r in results[1:]:
        assert r["evals"][-1]["eval/mtp_accuracy/1"] > r["evals"][0]["eval/mtp_accuracy/1"], (r["name"], r["evals"])
