"""The parts of an HF export on their own: YaRN fields (checked against the project's own
`rope_frequencies`), the MLA padding's refusals and its half-split rotary layout (against
transformers), and a converted tokenizer without the project's chat tokens."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from composer_jax.config import ConfigError, ModelConfig, RopeScalingConfig
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.hf.mla_pad import plan_padding
from composer_jax.hf.rope import export_rope, same_frequencies
from composer_jax.hf.tokenizer_files import hf_tokenizer_json, tokenizer_config, write_tokenizer_files

DEMO_YARN = RopeScalingConfig(
    type="yarn", factor=2.0, original_max_position_embeddings=256, mscale=1.0, mscale_all_dim=1.0
)
TINY = ModelConfig(vocab_size=256, num_layers=2, num_mtp_layers=0, max_position_embeddings=4096)


def _yarn(**kw) -> ModelConfig:
    return dataclasses.replace(TINY, rope_scaling=dataclasses.replace(DEMO_YARN, **kw))


@pytest.mark.parametrize("dim", [8, 64])
@pytest.mark.parametrize("yarn", [{}, {"original_max_position_embeddings": 1800}, {"factor": 8.0, "beta_fast": 16.0}])
def test_export_rope_covers_the_context_with_the_same_frequencies(dim, yarn):
    cfg = dataclasses.replace(_yarn(**yarn), qk_rope_head_dim=dim)
    got = export_rope(cfg)
    assert got is not None and got.note is None and got.max_position_embeddings == 4096
    rs = got.scaling
    assert rs.original_max_position_embeddings * rs.factor >= 4096
    assert same_frequencies(dim, cfg.rope_theta, cfg.rope_scaling, dim, rs)
    if not yarn:  # the demo's run: 2048 with the trained betas moves the ramp, so the betas move too
        naive = dataclasses.replace(cfg.rope_scaling, original_max_position_embeddings=2048)
        assert rs.original_max_position_embeddings == 2048 and rs.beta_fast != 32.0
        assert not same_frequencies(dim, cfg.rope_theta, cfg.rope_scaling, dim, naive)


def test_export_rope_keeps_fields_that_cover_and_caps_without_truncation():
    k2 = dataclasses.replace(_yarn(factor=32.0, original_max_position_embeddings=4096), max_position_embeddings=131072)
    assert export_rope(k2).scaling == k2.rope_scaling
    capped = export_rope(_yarn(truncate=False))
    assert capped.scaling == _yarn(truncate=False).rope_scaling and capped.max_position_embeddings == 512
    assert "capped at 512" in capped.note and "truncate=false" in capped.note


@pytest.mark.parametrize("yarn", [False, True])
def test_padded_rotary_frequencies_are_the_models_at_every_eighth_pair(yarn):
    cfg = _yarn() if yarn else TINY
    plan = plan_padding(cfg)
    new = plan.new
    assert (new.kv_lora_rank, new.qk_rope_head_dim, new.qk_nope_head_dim, plan.q_scale) == (512, 64, 32, 2.0)
    assert new.qk_head_dim == 4 * cfg.qk_head_dim  # softmax scale halves: the queries double
    assert same_frequencies(8, cfg.rope_theta, cfg.rope_scaling, 64, new.rope_scaling)
    assert plan.rope_dst.tolist() == [0, 1, 16, 17, 32, 33, 48, 49]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"kv_lora_rank": 48}, "the latent must repeat whole"),
        ({"kv_lora_rank": 1024}, "padding only grows dimensions"),
        ({"qk_rope_head_dim": 6}, "64 is not a multiple of 6"),
        ({"rope_scaling": dataclasses.replace(DEMO_YARN, truncate=False)}, "truncate=False"),
        ({"attention_type": "gqa", "num_kv_heads": 2, "head_dim": 16}, "applies to MLA models"),
    ],
)
def test_padding_that_cannot_be_exact_is_refused(change, match):
    with pytest.raises(ConfigError, match=match):
        plan_padding(dataclasses.replace(TINY, **change))


@pytest.mark.hf
def test_half_split_rotary_is_padded_into_the_interleaved_layout(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from composer_jax.hf.mla_pad import pad_mla
    from composer_jax.hf.weights import save_pretrained
    from composer_jax.model.params import abstract_params

    cfg = dataclasses.replace(_yarn(), rope_interleave=False, q_lora_rank=0)
    rng = np.random.default_rng(3)  # random weights without compiling init_params
    params = jax.tree.map(lambda s: (1 + 0.1 * rng.standard_normal(s.shape)).astype(s.dtype), abstract_params(cfg))
    save_pretrained(params, cfg, tmp_path / "a")
    pcfg, pparams = pad_mla(cfg, params)
    assert pcfg.rope_interleave
    save_pretrained(pparams, pcfg, tmp_path / "b")
    tokens = torch.tensor([np.random.default_rng(0).integers(0, 256, 10).tolist()])
    positions = torch.tensor([[0, 1, 2, 3, 600, 601, 2000, 3000, 4000, 4095]])
    logits = []
    for d in ("a", "b"):
        m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / d, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(m(tokens, position_ids=positions).logits.numpy())
    # float32 rounding of logits of this size (the weights are ~1, so the logits are ~10^2)
    np.testing.assert_allclose(logits[1], logits[0], atol=1e-6 * np.abs(logits[0]).max(), rtol=0)
    assert (logits[1].argmax(-1) == logits[0].argmax(-1)).all()


def _deepseek_like(tmp_path, own_template: str | None):
    """A tokenizer like a converted DeepSeek one: <s>/</s> named in tokenizer_config.json, BOS
    added by its own post-processor, no <|im_start|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    hf.train_from_iterator(["def f(x):\n    return x\n"] * 4, trainer=trainer)
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    src = tmp_path / "src"
    src.mkdir()
    hf.save(str(src / "tokenizer.json"))
    cfg = {"bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    if own_template:
        cfg["chat_template"] = own_template
    (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    return load_tokenizer(src), src


def test_tokenizer_without_chat_tokens_keeps_its_own_template(tmp_path):
    tok, src = _deepseek_like(tmp_path, "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
    config, note = tokenizer_config(tok, 128, src)
    assert config["chat_template"].startswith("{{ bos_token }}") and "its own chat_template is kept" in note
    assert json.loads(hf_tokenizer_json(tok))["post_processor"]["type"] == "TemplateProcessing"  # not doubled


@pytest.mark.hf
def test_tokenizer_without_chat_tokens_or_template_gets_a_clear_chat_error(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok, src = _deepseek_like(tmp_path, None)
    out = tmp_path / "out"
    out.mkdir()
    note = write_tokenizer_files(tok, out, 128, src)
    assert "<|im_start|>" in note
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok("def f").input_ids[0] == tok.bos_id  # BOS once, from its own post-processor
    assert hf_tok("def f").input_ids.count(tok.bos_id) == 1
    with pytest.raises(Exception, match="tokenizer has no <.im_start.>.*use completions"):
        hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_serve_says_chat_is_unavailable_for_a_tokenizer_without_chat_tokens(tmp_path):
    """`serve` with a converted DeepSeek-like tokenizer: one clear reason (said at start, and as the
    chat endpoint's `chat_unavailable` error), not a template error per message; completions work."""
    from composer_jax.formats.chatml import chat_unavailable
    from composer_jax.inference.server.openai_api import ApiError, parse_chat, parse_completion

    tok, _src = _deepseek_like(tmp_path, None)
    why = chat_unavailable(tok)
    assert why is not None and "<|im_start|>" in why and "/v1/completions" in why
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with pytest.raises(ApiError) as err:
        parse_chat(body, tok=tok, served="m", max_len=64, vocab=tok.vocab_size)
    assert err.value.code == "chat_unavailable" and err.value.status == 400 and str(err.value) == why
    gen = parse_completion({"prompt": "def f", "max_tokens": 4}, tok=tok, served="m", max_len=64, vocab=tok.vocab_size)
    assert gen.prompts and gen.prompts[0][0] == tok.bos_id
