"""ChatTemplate (formats/chat_template.py) against transformers' `apply_chat_template` as the oracle:
the fixture templates (tests/fixtures/chat_templates/, one per family) on a tokenizer with the
families' specials (tests/support/chat_templates.py), the bundled agent conversations and hand-made ones with
reasoning, several tool calls, tool results, tools and system prompts."""

import json
from pathlib import Path

import numpy as np
import pytest
from support.chat_templates import (
    EOS,
    FAMILIES,
    TEXT_ARGUMENT_TEMPLATES,
    chat_template,
    oracle,
    source,
    template_tok,
    vllm_messages,
)

from composer_jax.env.api.protocol import tool_schemas
from composer_jax.errors import ConfigError
from composer_jax.formats.chat_format import chat_format
from composer_jax.formats.chat_template import ChatTemplate

SFT = Path(__file__).resolve().parents[2] / "assets/sft/train.jsonl"


def _bundled(n: int = 3) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in SFT.read_text().splitlines()[:n]]


def _call(i: str, name: str, args: dict) -> dict:
    return {"id": i, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


HANDMADE = [
    {"role": "system", "content": "You fix bugs. Unicode: héllo — ✓ <b>&</b>"},
    {"role": "user", "content": "Tests fail in  cron.py\n\n"},
    {
        "role": "assistant",
        "reasoning_content": "\nLook at the file, then grep.\n",
        "content": "Reading it.",
        "tool_calls": [
            _call("c1", "read_file", {"path": "/app/cron.py", "start_line": 1}),
            _call("c2", "grep", {"pattern": "def match<", "path": "/app"}),
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "def match(x):\n    return x < 1\n"},
    {"role": "tool", "tool_call_id": "c2", "content": "cron.py:1:def match(x):"},
    {"role": "assistant", "content": None, "tool_calls": [_call("c3", "run_shell", {"command": "pytest -q"})]},
    {"role": "tool", "tool_call_id": "c3", "content": "1 failed"},
    {"role": "assistant", "content": "Found it: `x < 1` should be `x <= 1`."},
]
SMALL = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": "A", "tool_calls": [_call("c1", "t", {"x": 1})]},
    {"role": "tool", "tool_call_id": "c1", "content": "R"},
    {"role": "assistant", "content": "Done."},
]


def _reference(family: str, messages, tools=None, add_generation_prompt=False, **kw):
    return oracle().apply_chat_template(
        vllm_messages(messages, text_arguments=family in TEXT_ARGUMENT_TEMPLATES),
        tools=tools,
        chat_template=source(family),
        tokenize=True,
        add_generation_prompt=add_generation_prompt,
        return_dict=bool(kw),
        **kw,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_renders_token_for_token_as_transformers(family):
    fmt = chat_template(family)
    for messages in [*_bundled(2), HANDMADE]:
        for tools in (None, tool_schemas()):
            for gen in (False, True):
                assert fmt.render_ids(messages, tools, gen) == _reference(family, messages, tools, gen)
    # the comparison can fail: the same conversation with one character changed renders otherwise
    perturbed = [*HANDMADE[:-1], {"role": "assistant", "content": "Found it: `x < 1` should be `x <= 2`."}]
    assert fmt.render_ids(perturbed) != _reference(family, HANDMADE)


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_conversation_is_transformers_rendering(family):
    """History-keeping conversations (one user message): `conversation`'s ids are the template's."""
    fmt = chat_template(family)
    for messages in [*_bundled(3), SMALL, HANDMADE]:
        ids, mask = fmt.conversation(messages)
        assert ids.dtype == np.int32 and mask.dtype == np.float32 and ids.shape == mask.shape
        assert ids.tolist() == _reference(family, messages)


MASKED = {  # SMALL's masked text per family: each assistant turn through its end token, nothing else
    "qwen3": ['A\n<tool_call>\n{"name": "t", "arguments": {"x": 1}}\n</tool_call><|im_end|>', "Done.<|im_end|>"],
    "qwen3_coder": [
        "A\n<tool_call>\n<function=t>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call><|im_end|>",
        "Done.<|im_end|>",
    ],
    "deepseek_v3": [
        "A<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>t\n```json\n"
        '{"x": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
        "Done.<｜end▁of▁sentence｜>",
    ],
    "kimi_k2": [
        "A<|tool_calls_section_begin|><|tool_call_begin|>functions.t:0<|tool_call_argument_begin|>"
        '{"x": 1}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
        "Done.<|im_end|>",
    ],
}


def _masked_runs(ids: np.ndarray, mask: np.ndarray) -> list[str]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0.0], mask, [0.0]])))
    return [template_tok().decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2], strict=True)]


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_mask_is_exactly_the_assistant_turns(family):
    fmt = chat_template(family)
    ids, mask = fmt.conversation(SMALL)
    assert _masked_runs(ids, mask) == MASKED[family]
    assert set(mask.tolist()) == {0.0, 1.0}
    # perturbed: one token more or less in the mask no longer spells the turns
    wrong = mask.copy()
    wrong[int(np.flatnonzero(mask)[0]) - 1] = 1.0
    assert _masked_runs(ids, wrong) != MASKED[family]


@pytest.mark.parametrize("family", ["qwen3_coder", "kimi_k2"])
def test_generation_blocks_give_transformers_assistant_mask(family):
    fmt = chat_template(family)
    assert fmt.has_generation_blocks
    for messages in [*_bundled(2), HANDMADE]:
        ids, mask = fmt.conversation(messages)
        ref = _reference(family, messages, return_assistant_tokens_mask=True)
        assert ids.tolist() == ref["input_ids"]
        assert mask.astype(int).tolist() == ref["assistant_masks"]


@pytest.mark.parametrize("family", FAMILIES)
def test_agent_loop_prompts_are_transformers_renderings(family):
    """prompt(m) + the turn's tokens + continuation(more) is the template's prompt for m + turn + more."""
    fmt = chat_template(family)
    for messages in [_bundled(1)[0][:9], HANDMADE]:
        whole, mask = fmt.conversation(messages)
        starts = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        ids = fmt.prompt(messages[: starts[0]]).tolist()
        for k, at in enumerate(starts[:-1]):
            n = len(ids)
            while mask[n] == 1.0:
                n += 1
            ids += whole[len(ids) : n].tolist() + fmt.continuation(messages[at + 1 : starts[k + 1]]).tolist()
            assert ids == _reference(family, messages[: starts[k + 1]], add_generation_prompt=True)


def test_rewritten_history_keeps_the_sampled_tokens():
    """Qwen3 drops the <think> of turns before the last user message when it renders the whole
    conversation; the agent loop and `conversation` keep the tokens the model sampled."""
    fmt = chat_template("qwen3")
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "reasoning_content": "R1", "content": "A1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "reasoning_content": "R2", "content": "A2"},
    ]
    ids, mask = fmt.conversation(messages)
    assert _masked_runs(ids, mask) == ["<think>\nR1\n</think>\n\nA1<|im_end|>", "<think>\nR2\n</think>\n\nA2<|im_end|>"]
    first = fmt.prompt(messages[:1]).tolist() + fmt.tok.encode_with_specials("<think>\nR1\n</think>\n\nA1<|im_end|>")
    second = first + fmt.continuation(messages[2:3]).tolist()
    assert ids[: len(second)].tolist() == second
    # reasoning given under transformers' other names reaches the template as reasoning_content
    renamed = [{"reasoning" if k == "reasoning_content" else k: v for k, v in m.items()} for m in messages]
    assert fmt.conversation(renamed)[0].tolist() == ids.tolist()
    # the template's own rendering of the whole conversation differs: R1 is gone there
    reference = _reference("qwen3", messages)
    assert ids.tolist() != reference and "R1" not in template_tok().decode(reference)


def test_prefix_violation_names_the_template():
    bad = (  # the last assistant turn gets a "model" header, the generation prompt an "assistant" one
        "{% for m in messages %}<|im_start|>{{ 'model' if m.role == 'assistant' else m.role }}\n"
        "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fmt = ChatTemplate(bad, template_tok(), name="bad-template")
    with pytest.raises(ConfigError, match="bad-template.*not a token prefix"):
        fmt.conversation(SMALL[1:3], where="row 7")
    with pytest.raises(ConfigError, match="row 7"):
        fmt.conversation(SMALL[1:3], where="row 7")


def test_generation_block_without_end_token_is_refused():
    src = source("kimi_k2").replace(
        "{{- '<|im_end|>' }}\n        {%- endgeneration %}", "{%- endgeneration %}<|im_end|>"
    )
    assert src != source("kimi_k2")
    fmt = ChatTemplate(src, template_tok(), name="kimi-open-end")
    with pytest.raises(ConfigError, match="kimi-open-end.*end-of-turn"):
        fmt.conversation(SMALL)


def test_family_facts():
    tok = template_tok()
    ids = tok.hf.token_to_id
    assert chat_template("qwen3").tool_syntax == "hermes"
    assert chat_template("qwen3_coder").tool_syntax == "qwen3_coder"
    assert chat_template("deepseek_v3").end_of_turn == (ids(EOS),)
    assert chat_template("deepseek_v3").call_start == (ids("<｜tool▁calls▁begin｜>"),)
    assert chat_template("kimi_k2").call_end == (ids("<|tool_call_end|>"),)
    assert all(chat_template(f).native_tools and chat_template(f).unavailable() is None for f in FAMILIES)
    plain = ChatTemplate(
        "{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
        tok,
        name="plain",
        variables={"eos_token": EOS},
    )
    assert plain.tool_syntax is None and plain.call_start == () and plain.end_of_turn == (ids(EOS),)
    assert "'r' refused the conversation: no" in str(
        ChatTemplate("{{ raise_exception('no') }}", tok, name="r").unavailable()
    )
    with pytest.raises(ConfigError, match="'r' refused the conversation: no"):
        ChatTemplate("{{ raise_exception('no') }}", tok, name="r").render([])


def test_chat_format_picks_the_checkpoints_template(tmp_path):
    """A tokenizer without composer-chatml-v1's tokens whose directory holds a template speaks it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from composer_jax.formats.tokenizer import load_tokenizer

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer, hf.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    specials = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]
    specials += ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>"]
    specials += ["<|tool_call_argument_begin|>", "<|tool_call_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(["hello world"], trainer=trainer)
    hf.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "[BOS]", "eos_token": {"content": "[EOS]"}, "chat_template": source("kimi_k2")}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    fmt = chat_format(tok)
    assert isinstance(fmt, ChatTemplate) and fmt.family == "kimi_k2" and fmt.name == tmp_path.name
    assert fmt.variables == {"bos_token": "[BOS]", "eos_token": "[EOS]"}
    assert fmt.end_of_turn == (hf.token_to_id("<|im_end|>"),)
    ids = fmt.prompt(SMALL[:2]).tolist()
    assert tok.decode(ids).endswith("<|im_end|><|im_assistant|>assistant<|im_middle|>")
    # a chat_template.jinja file wins over the config; none at all is refused, naming what is accepted
    (tmp_path / "chat_template.jinja").write_text(source("qwen3"))
    assert ChatTemplate.load(tmp_path, tok).family == "qwen3"
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="no chat template: accepted are a chat_template.jinja"):
        ChatTemplate.load(tmp_path, tok)
