"""`composer-jax serve` / `sample`: the speculative-decoding options (--speculative-tokens,
--draft-experts, --draft-vocab) parse into the Sampler's keyword arguments and bad values are
refused with a message naming them (parsing only: no model is loaded)."""

from __future__ import annotations

import argparse

import pytest

from composer_jax.inference.server.cli import _sample_parser, _serve_parser, speculative_options

PARSERS = {"serve": _serve_parser, "sample": _sample_parser}
BASE = {"serve": ["--checkpoint", "ckpt"], "sample": ["--checkpoint", "ckpt", "--prompt", "x"]}


def _parse(which: str, extra: list[str]) -> dict:
    p = PARSERS[which]()
    return speculative_options(p, p.parse_args(BASE[which] + extra))


@pytest.mark.parametrize("which", ["serve", "sample"])
def test_speculative_options_reach_the_sampler_arguments(which, tmp_path):
    assert _parse(which, []) == {"speculative_tokens": 0, "draft_experts": None, "draft_vocab": None}
    as_json, as_text = tmp_path / "ids.json", tmp_path / "ids.txt"
    as_json.write_text("[5, 3, 9]")
    as_text.write_text("7 2,\n11\n")
    got = _parse(which, ["--speculative-tokens", "3", "--draft-experts", "0", "--draft-vocab", str(as_json)])
    assert got == {"speculative_tokens": 3, "draft_experts": 0, "draft_vocab": [5, 3, 9]}
    got = _parse(which, ["--speculative-tokens", "2", "--draft-vocab", str(as_text)])
    assert got == {"speculative_tokens": 2, "draft_experts": None, "draft_vocab": [7, 2, 11]}


@pytest.mark.parametrize("which", ["serve", "sample"])
def test_bad_speculative_options_are_refused_with_their_value(which, tmp_path, capsys):
    bad_ids, empty, negative = tmp_path / "bad.txt", tmp_path / "empty.json", tmp_path / "neg.txt"
    bad_ids.write_text("1 two 3")
    empty.write_text("[]")
    negative.write_text("4 -1")
    cases = [
        (["--speculative-tokens", "-1"], "argument --speculative-tokens: -1 must be >= 0"),
        (["--speculative-tokens", "two"], "argument --speculative-tokens: 'two' is not an integer"),
        (["--speculative-tokens", "2", "--draft-experts", "-3"], "argument --draft-experts: -3 must be >= 0"),
        (["--draft-experts", "1"], "--draft-experts needs --speculative-tokens >= 1 (got 0)"),
        (["--speculative-tokens", "1", "--draft-vocab", str(empty)], "holds no ids; give at least one token id"),
        (["--speculative-tokens", "1", "--draft-vocab", str(bad_ids)], f"{str(bad_ids)!r} is not a list of token ids"),
        (["--speculative-tokens", "1", "--draft-vocab", str(negative)], "holds negative id -1"),
        (["--speculative-tokens", "1", "--draft-vocab", str(tmp_path / "missing")], "cannot read"),
    ]
    for extra, message in cases:
        with pytest.raises(SystemExit) as exc:
            _parse(which, extra)
        assert exc.value.code == 2, extra
        err = capsys.readouterr().err
        assert message in err, (extra, err)


def test_type_checks_name_the_accepted_values():
    from composer_jax.inference.server.cli import _non_negative_int, _token_ids_file

    assert _non_negative_int("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match="-2 must be >= 0"):
        _non_negative_int("-2")
    with pytest.raises(argparse.ArgumentTypeError, match="JSON list of integers"):
        _token_ids_file(__file__)  # a Python file is not a list of ids
