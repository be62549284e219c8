"""`composer-jax inspect` on an RL config (one with an `rl:` section): the RL trainer step's memory
per device with a fit verdict, the GPUs one vLLM replica of the policy needs, and the resources the
run asks Ray for.

The trainer (rl/learner.py) runs three phases a step, each with the train state resident (the
policy's parameters and AdamW moments) and, when rl.loss.kl_coef > 0, the frozen reference copy
of the parameters (sharded like them; none with train.lora, whose frozen base is the reference):

  reference  the reference policy's log-probs of the batch (`rl.loss.reference_logprobs`, forward
             only, one train.micro_batches share of the rows at a time): the step's batch, one
             gathered layer of the reference weights, a micro-batch's forward working set (two
             residual-stream copies and the largest layer's working set per token) and the
             log-probs' head chunk (logits and exponentials);
  step       the policy's log-probs and gradients (`make_train_step` with the RL objective): what
             `accounting.memory_per_device` counts for pretraining at the same micro-batches and
             sequence length (gradients, FSDP buffers, activations with the chunked log-prob head),
             plus the batch and its prediction-aligned copy (`prepare`), the reference log-probs
             and, with router replay, the recorded experts int32[moe_layers, k] per token;
  publish    the copy of the new parameters handed to the samplers (`_copy` in the trainer).

The peak is the largest phase; the verdict is against train.device as for pretraining.

A vLLM replica (`replica`): weights at the serving precision W = D + E (E the routed experts, D the
rest), the KV cache of C sequences (rl.sampler.slots, what one replica decodes together) of L tokens
(train.seq_len, a generation's prompt plus completion), K = C L x `accounting.kv_bytes_per_token`
(MLA caches the latent kv_lora_rank + qk_rope_head_dim values per layer), and per GPU u x M usable
(M the device's memory, u vLLM's --gpu-memory-utilization, default 0.9). Two layouts of N GPUs:
  tensor parallel:            W / N + K <= u M  (MLA's latent is one per token, not per head: every
                              tensor-parallel rank holds the whole cache; a GQA cache splits over up
                              to its KV heads);
  data-parallel attention +   D + E / N + K / N <= u M  (attention, embedding and dense weights on
  expert parallel:            every GPU; experts and sequences split N ways), N >= (E + K) / (u M - D).
N is the smallest power of two that fits (dividing the heads, resp. the experts); the activation
workspace and CUDA graphs come out of the same u M in vLLM, so the counts are lower bounds.

What the run asks Ray for (`ray_resources`; printed whatever rl.placement says, docs/cluster.md):
the rl.local_samplers replicas, each rl.ray.sampler_cpus CPUs, rl.ray.sampler_gpus GPUs and one
unit of rl.ray.sampler_resource; the rl.env_servers environment servers, each
rl.ray.env_server_cpus CPUs and one unit of rl.ray.env_server_resource. Replicas and servers given
by URL (rl.sampler_urls, rl.env_urls) run elsewhere: nothing is placed for them. The trainer is not
placed by Ray: it is the driver, the process `composer-jax rl` runs as, on the node where the command
runs (more hosts: the same command on each, joined by jax.distributed, docs/scaling.md), and it holds
that node's devices; its hosts and devices per host are printed for sizing that node (`GPUS_PER_HOST`
GPUs a host, an HGX / DGX node, or `TPU_CHIPS_PER_HOST` TPU chips; a CPU run's devices all in one
process on one host) and left out of the totals. vLLM replicas are never placed by Ray (config:
rl.placement=ray refuses rl.sampler_engine=vllm with rl.local_samplers).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from composer_jax.config import Config
from composer_jax.model import accounting
from composer_jax.sharding import ShardingRules

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's --gpu-memory-utilization default
SERVE_PRECISIONS = ("bfloat16", "float32", "fp8")
MAX_REPLICA_GPUS = 1024
GPUS_PER_HOST = 8  # HGX / DGX H100, H200, B200 (as inspection.GPUS_PER_NODE)
TPU_CHIPS_PER_HOST = 4  # a multi-host Cloud TPU slice's VM (v4, v5e, v5p, v6e)
ACCELERATORS = ("cpu", "gpu", "tpu")
_INT32 = 4
_F32 = 4


def _batch_bytes_per_token(cfg: Config) -> float:
    """The RL batch's bytes per token: BASE_KEYS (six int32 / float32 arrays), ref_logprobs and the
    recorded routing when used; twice, for `prepare`'s prediction-aligned copy."""
    m, lc = cfg.model, cfg.rl.loss
    n = 6 + (1 if lc.kl_coef > 0 else 0)
    routing = m.num_moe_layers * m.num_experts_per_tok * _INT32 if lc.router_replay and m.num_moe_layers else 0
    return 2 * (n * 4 + routing)


def rl_trainer_memory(
    cfg: Config,
    rules: ShardingRules,
    sizes: Mapping[str, int],
    mem: Mapping[str, Any],
    batch: int,
    seq: int,
    micro_batches: int,
    head_chunks: int | None,
) -> dict[str, Any]:
    """Per-device bytes of the RL trainer's three phases (module docstring), `mem` being
    `accounting.memory_per_device` of the same model, mesh, batch, seq and micro-batches."""
    m, lc = cfg.model, cfg.rl.loss
    shards = accounting.batch_shards(rules, sizes)
    tokens = batch / shards * seq / sizes["context"]  # the whole step's tokens per device
    mb_tokens = tokens / micro_batches
    state = mem["params"] + mem["optimizer"]
    # (with train.lora the reference policy is the frozen base itself: no copy)
    reference = mem["params"] if lc.kl_coef > 0 and not cfg.train.lora.enabled else 0.0
    batch_bytes = tokens * _batch_bytes_per_token(cfg)
    ref_logprobs = tokens * _F32 if lc.kl_coef > 0 else 0.0
    row = m.vocab_size / sizes["tensor"] * _F32
    chunks = head_chunks or 1
    ref_forward = 0.0
    if lc.kl_coef > 0:
        gathered_layer = mem["fsdp_buffers"] / 2  # one layer and the head, without their gradients
        ref_forward = (
            gathered_layer
            + mb_tokens * accounting.forward_bytes_per_token(m, sizes, seq)
            + 2 * mb_tokens / chunks * row
        )
    phases = {
        "reference": state + reference + batch_bytes + ref_forward + ref_logprobs,
        "step": mem["total"] + reference + batch_bytes + ref_logprobs,
        "publish": state + reference + mem["params"],
    }
    peak = max(phases, key=lambda k: phases[k])
    return {
        "tokens_per_device": tokens,
        "micro_batch_tokens_per_device": mb_tokens,
        "policy_step": mem["total"],
        "reference_params": reference,
        "reference_forward": ref_forward,
        "reference_logprobs": ref_logprobs,
        "batch": batch_bytes,
        "publish_copy": mem["params"],
        "phases": phases,
        "peak_phase": peak,
        "total": phases[peak],
    }


def _replica_layout(
    weights: float, dense: float, experts: float, kv: float, usable: float, cfg: Config
) -> dict[str, Any]:
    """Smallest power-of-two N for each layout (module docstring); None where none up to
    MAX_REPLICA_GPUS fits."""
    m = cfg.model
    kv_splits_tp = 1 if m.attention_type == "mla" else m.num_kv_heads
    out: dict[str, Any] = {}
    n = 1
    tp = ep = None
    while n <= MAX_REPLICA_GPUS:
        if tp is None and m.num_heads % n == 0 and weights / n + kv / min(n, kv_splits_tp) <= usable:
            tp = n
        if ep is None and m.num_experts and m.num_experts % n == 0 and dense + (experts + kv) / n <= usable:
            ep = n
        n *= 2
    out["tensor_parallel"] = tp
    if tp is None:
        out["tensor_parallel_note"] = (
            f"every rank holds the whole {_gb(kv)} latent cache"
            if m.attention_type == "mla" and kv >= usable
            else f"no power of two dividing the {m.num_heads} heads fits"
        )
    out["dp_attention_expert_parallel"] = ep
    out["ep_bound"] = (experts + kv) / (usable - dense) if m.num_experts and usable > dense else math.inf
    choices = [g for g in (tp, ep) if g is not None]
    out["gpus"] = min(choices) if choices else None
    return out


def replica(
    cfg: Config,
    rows: list[accounting.ParamRow],
    device_bytes: float,
    *,
    precision: str,
    utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
) -> dict[str, Any]:
    """One vLLM replica of the policy at `precision` (module docstring): weights, KV cache and the
    GPUs of each layout on devices of `device_bytes`."""
    m = cfg.model
    main = [r for r in rows if r.component != "mtp"]  # vLLM loads MTP only for speculative decoding
    experts = accounting.serving_weight_bytes([r for r in main if r.component == "routed_experts"], precision)
    dense = accounting.serving_weight_bytes([r for r in main if r.component != "routed_experts"], precision)
    per_token = accounting.kv_bytes_per_token(m, m.compute_dtype)
    sequences, length = cfg.rl.sampler.slots, cfg.train.seq_len
    kv = per_token * sequences * length
    usable = utilization * device_bytes
    return {
        "precision": precision,
        "weights": dense + experts,
        "routed_experts": experts,
        "dense": dense,
        "kv_dtype": m.compute_dtype,
        "kv_bytes_per_token": per_token,
        "sequences": sequences,
        "seq_len": length,
        "kv_cache": kv,
        "utilization": utilization,
        "usable_per_gpu": usable,
        **_replica_layout(dense + experts, dense, experts, kv, usable, cfg),
    }


def ray_resources(cfg: Config, devices: int, accelerator: str) -> dict[str, Any]:
    """What the run asks Ray for (module docstring): the replicas' and environment servers' counts and
    per-actor resources, the totals over these placed actors (custom resources by name), and, beside
    them, the trainer's hosts and devices per host for a mesh of `devices` on `accelerator` (one of
    ACCELERATORS): the driver's, not asked of Ray and not in the totals."""
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator {accelerator!r}: accepted: {', '.join(ACCELERATORS)}")
    r, ray = cfg.rl, cfg.rl.ray
    per_host = min(devices, {"gpu": GPUS_PER_HOST, "tpu": TPU_CHIPS_PER_HOST}.get(accelerator, devices))
    trainer: dict[str, Any] = {
        "accelerator": accelerator,
        "devices": devices,
        "devices_per_host": per_host,
        "hosts": -(-devices // per_host),
        "even": devices % per_host == 0,
        "placed_by_ray": False,  # the driver: where the command runs
    }
    if cfg.train.placement == "ray":  # one trainer actor per host (train.ray, runtime/ray_trainer.py)
        tr = cfg.train.ray
        trainer.update(
            placed_by_ray=True,
            hosts=tr.hosts,
            cpus=tr.cpus_per_host,
            gpus=tr.gpus_per_host,
            resource=tr.resource,
            even=devices == tr.hosts * per_host if accelerator != "cpu" else trainer["even"],
        )
    replicas: dict[str, Any] = {
        "engine": r.sampler_engine,
        "count": r.local_samplers,
        "by_url": len(r.sampler_urls),
        "cpus": ray.sampler_cpus,
        "gpus": ray.sampler_gpus,
        "resource": ray.sampler_resource,
    }
    env_servers: dict[str, Any] = {
        "count": 0 if r.env_urls else r.env_servers,
        "by_url": len(r.env_urls),
        "cpus": ray.env_server_cpus,
        "resource": ray.env_server_resource,
    }
    custom: dict[str, int] = {}
    for actors in (replicas, env_servers):
        if actors["resource"] and actors["count"]:
            custom[actors["resource"]] = custom.get(actors["resource"], 0) + actors["count"]
    totals = {
        "cpus": replicas["count"] * replicas["cpus"] + env_servers["count"] * env_servers["cpus"],
        "gpus": replicas["count"] * replicas["gpus"],
        "custom": custom,
    }
    if trainer["placed_by_ray"]:
        totals["cpus"] += trainer["hosts"] * trainer["cpus"]
        totals["gpus"] += trainer["hosts"] * trainer["gpus"]
        if trainer["resource"]:
            custom[trainer["resource"]] = custom.get(trainer["resource"], 0) + trainer["hosts"]
    return {
        "placement": r.placement,
        "address": ray.address,
        "trainer": trainer,
        "replicas": replicas,
        "env_servers": env_servers,
        "totals": totals,
    }


def rl_report(
    cfg: Config,
    report: Mapping[str, Any],
    rows: list[accounting.ParamRow],
    rules: ShardingRules,
    sizes: Mapping[str, int],
    head_chunks: int | None,
    *,
    device_bytes: float | None,
    accelerator: str,
    serve_precision: str,
    utilization: float,
    min_headroom: float,
) -> dict[str, Any]:
    """The report's `rl` part: the trainer's phases and verdict, the replicas at `serve_precision`
    and at the other precisions of `SERVE_PRECISIONS` the weights are commonly served in, and what
    the run asks Ray for with the trainer's devices on `accelerator` (`ray_resources`)."""
    mem = report["memory_per_device"]
    trainer = rl_trainer_memory(
        cfg, rules, sizes, mem, report["batch"], report["seq"], report["micro_batches"], head_chunks
    )
    out: dict[str, Any] = {
        "trainer": trainer,
        "group_size": cfg.rl.group_size,
        "groups_per_step": cfg.rl.groups_per_step,
        "max_staleness": cfg.rl.max_staleness,
        "kl_coef": cfg.rl.loss.kl_coef,
        "router_replay": cfg.rl.loss.router_replay,
        "sampler_urls": len(cfg.rl.sampler_urls),
        "env_urls": len(cfg.rl.env_urls),
        "ray_resources": ray_resources(cfg, math.prod(sizes.values()), accelerator),
    }
    if device_bytes is not None:
        free = device_bytes - trainer["total"]
        out["trainer_fits"] = free >= min_headroom * device_bytes
        out["trainer_headroom_fraction"] = free / device_bytes
        precisions = [serve_precision] + [p for p in ("bfloat16", "fp8") if p != serve_precision]
        out["replicas"] = [replica(cfg, rows, device_bytes, precision=p, utilization=utilization) for p in precisions]
    return out


def _gb(x: float) -> str:
    return f"{x / 1e9:,.1f} GB" if x >= 1e8 else f"{x / 2**20:.2f} MiB"


def _gpus(n: int | None) -> str:
    if n is None:
        return f"none up to {MAX_REPLICA_GPUS} GPUs"
    nodes = -(-n // 8)
    return f"{n} GPU{'s' if n > 1 else ''} ({nodes} node{'s' if nodes > 1 else ''} of 8)"


def _cpus(n: float) -> str:
    return f"{n:g} CPU{'' if n == 1 else 's'}"


def _actors(a: Mapping[str, Any], gpus: bool, by_url: str) -> str:
    """`N x (C CPUs[, G GPUs][, 1 RESOURCE])`, or why none is placed."""
    if not a["count"]:
        return f"none placed ({a['by_url']} by {by_url})" if a["by_url"] else "none"
    each = [_cpus(a["cpus"])]
    if gpus:
        each.append(f"{a['gpus']} GPU{'' if a['gpus'] == 1 else 's'}")
    if a["resource"]:
        each.append(f"1 {a['resource']}")
    return f"{a['count']} x ({', '.join(each)})"


def format_ray(x: Mapping[str, Any]) -> list[str]:
    """The text report's lines on what the run asks Ray for (`ray_resources`)."""
    t, rep, env, tot = x["trainer"], x["replicas"], x["env_servers"], x["totals"]
    head = (
        "resources the run asks Ray for (rl.placement: ray; cluster: "
        + (f"rl.ray.address {x['address']})" if x["address"] else "RAY_ADDRESS, else a local one the run starts)")
        if x["placement"] == "ray"
        else "resources the run would ask Ray for (rl.placement: local: its services run as child processes on "
        "this machine; --placement ray places them on a Ray cluster)"
    )
    unit = {"gpu": "GPU", "tpu": "TPU chip", "cpu": "CPU device"}[t["accelerator"]]
    per = f"{t['devices_per_host']} {unit}{'' if t['devices_per_host'] == 1 else 's'}"
    trainer = f"{t['hosts']} host{'' if t['hosts'] == 1 else 's'} x {per}"
    if t["placed_by_ray"]:
        each = [_cpus(t["cpus"])] + ([f"{t['gpus']} GPU{'' if t['gpus'] == 1 else 's'}"] if t["gpus"] else [])
        each += [f"1 {t['resource']}"] if t["resource"] else []
        trainer += f" = {t['hosts']} x ({', '.join(each)})"
        note = "placed by Ray: one actor per host, STRICT_SPREAD, joined by jax.distributed (train.ray)"
    elif t["hosts"] == 1:
        note = "not placed by Ray: the driver, on the node where the command runs"
    else:
        note = "not placed by Ray: the command on each host, joined by jax.distributed (docs/scaling.md)"
    if t["accelerator"] == "cpu":
        note += "; no accelerator: give --device to size GPU hosts"
    if not t["even"]:
        note += f"; the mesh's {t['devices']} devices do not fill the hosts evenly"
    sampler = "the in-process sampler" if not (rep["count"] or rep["by_url"]) else f"{rep['engine']}"
    total = [_cpus(tot["cpus"]), f"{tot['gpus']} GPU{'' if tot['gpus'] == 1 else 's'}"]
    total += [f"{k} {v:g}" for k, v in tot["custom"].items()]
    lines = [
        "",
        head,
        f"  trainer          {trainer}   (mesh of {t['devices']} device{'' if t['devices'] == 1 else 's'}; {note})",
        f"  sampler replicas {_actors(rep, True, 'rl.sampler_urls')}   ({sampler}, rl.local_samplers)",
        f"  env servers      {_actors(env, False, 'rl.env_urls')}   (rl.env_servers)",
        f"  total            {', '.join(total)}"
        + ("" if t["placed_by_ray"] else " (the trainer not counted: it runs outside Ray)"),
    ]
    return lines


def format_rl(r: Mapping[str, Any], gib) -> list[str]:
    """The text report's RL lines (`gib` formats bytes as the rest of the report does)."""
    t = r["trainer"]
    ph = t["phases"]
    lines = [
        "",
        f"RL trainer step per device (groups {r['groups_per_step']} x {r['group_size']} rollouts, max staleness "
        f"{r['max_staleness']}, k1 KL coef {r['kl_coef']:g}, router replay {'on' if r['router_replay'] else 'off'}; "
        f"{t['tokens_per_device']:,.0f} tokens per device a step, {t['micro_batch_tokens_per_device']:,.0f} per "
        "micro-batch)",
        f"  policy step      {gib(t['policy_step']):>12}   (log-probs and gradients: the memory per device above)",
        f"  reference copy   {gib(t['reference_params']):>12}   "
        + (
            "(none: rl.loss.kl_coef 0)"
            if r["kl_coef"] <= 0
            else "(none: with train.lora the frozen base is the reference)"
            if t["reference_params"] == 0
            else "(rl.loss.kl_coef > 0: frozen, sharded as the policy)"
        ),
        f"  reference fwd    {gib(t['reference_forward']):>12}   (forward only, one micro-batch at a time)",
        f"  batch            {gib(t['batch'] + t['reference_logprobs']):>12}   (rollout arrays, routing, "
        "reference log-probs, prepared copy)",
        f"  phases: reference {gib(ph['reference'])}, step {gib(ph['step'])}, publish {gib(ph['publish'])}; "
        f"peak {gib(t['total'])} ({t['peak_phase']})",
    ]
    if "trainer_fits" in r:
        lines.append(
            f"  RL trainer verdict: {'FITS' if r['trainer_fits'] else 'DOES NOT FIT'} "
            f"({r['trainer_headroom_fraction']:.1%} of the device free)"
        )
    for i, rep in enumerate(r.get("replicas", [])):
        if i == 0:
            lines += [
                "",
                f"vLLM replica of the policy ({r['sampler_urls']} in rl.sampler_urls): "
                f"{rep['sequences']} sequences (rl.sampler.slots) x {rep['seq_len']:,} tokens (train.seq_len), "
                f"{rep['utilization']:g} x device memory usable = {_gb(rep['usable_per_gpu'])} per GPU",
                f"  KV cache {rep['kv_dtype']} {rep['kv_bytes_per_token']:,.0f} B/token -> {_gb(rep['kv_cache'])}",
            ]
        tag = "serving precision" if i == 0 else "alternative"
        tp, ep = rep["tensor_parallel"], rep["dp_attention_expert_parallel"]
        lines += [
            f"  {rep['precision']} ({tag}): weights {_gb(rep['weights'])} = routed experts "
            f"{_gb(rep['routed_experts'])} + the rest {_gb(rep['dense'])}",
            f"    tensor parallel: {_gpus(tp) if tp else 'does not fit (' + rep['tensor_parallel_note'] + ')'}; "
            f"DP attention + EP: {_gpus(ep)} (N >= {rep['ep_bound']:.1f})",
        ]
        if i == 0:
            lines.append(f"  replica size at {rep['precision']}: {_gpus(rep['gpus'])}")
    return lines + format_ray(r["ray_resources"])
