"""One pretraining or SFT stage: data -> sharded step -> logs, held-out perplexity, checkpoints.

The stage supplies the trainer shell (`train/shell.py`, the loop every trainer runs) its parts:
the next batch and the step, the held-out evaluation, a checkpoint with the data position.

`run_stage(cfg)` resumes from the stage's latest good checkpoint when there is one (bit-exact: the
data iterator state is saved with every checkpoint), otherwise starts from `train.init_from` (the
previous stage's parameters, fresh optimiser) or from scratch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from composer_jax.checkpoint.manager import TrainCheckpointer
from composer_jax.config import Config, ConfigError, SourceConfig, to_dict
from composer_jax.data.shards import (
    host_eval_batches,
    host_shards,
    make_host_iterator,
    merge_states,
    shard_count,
    stack_eval_batches,
)
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.hf.init_from import describe_init, fresh_record, load_init_params, resolve_model_from
from composer_jax.model.accounting import flops_per_token, param_rows
from composer_jax.multihost import allgather_json
from composer_jax.sharding import ShardingRules, make_mesh
from composer_jax.train.observe import measure_peak_flops, scalars
from composer_jax.train.optimizer import learning_rate_schedule
from composer_jax.train.pretrain import pretraining_objective
from composer_jax.train.shell import Cadence, Evaluation, Parts, StepLog, TrainerShell, run_to_end
from composer_jax.train.state import abstract_train_state, init_train_state
from composer_jax.train.step import BATCH_KEYS, batch_sharding, make_eval_step, make_train_step

log = logging.getLogger(__name__)


def run_tokenizer(cfg: Config) -> Any:
    """The run's tokenizer (data.tokenizer), checked to fit the model's vocabulary."""
    tok = load_tokenizer(cfg.data.tokenizer)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer {cfg.data.tokenizer!r} has {tok.vocab_size} tokens but "
            f"model.vocab_size={cfg.model.vocab_size}; accepted: model.vocab_size >= {tok.vocab_size}"
        )
    return tok


def run_checkpoint_config(cfg: Config) -> Any:
    """The checkpoint section with its directory defaulted to <train.out_dir>/checkpoints."""
    if cfg.checkpoint.directory:
        return cfg.checkpoint
    return dataclasses.replace(cfg.checkpoint, directory=str((Path(cfg.train.out_dir) / "checkpoints").resolve()))


def _global_batch(local: dict, mesh, rules, shape, keys: tuple[str, ...] = BATCH_KEYS) -> dict:
    sharding = batch_sharding(mesh, rules, shape)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(local[k]), shape) for k in keys}


def _host_rows(mesh, rules, shape) -> tuple[int, int]:
    """The rows [start, stop) of a global [batch, seq] batch that this process's devices hold."""
    index = batch_sharding(mesh, rules, shape).addressable_devices_indices_map(shape).values()
    rows = [range(*i[0].indices(shape[0])) if i else range(shape[0]) for i in index]
    start, stop = min(r.start for r in rows), max(r.stop for r in rows)
    if set().union(*map(set, rows)) != set(range(start, stop)):
        raise ConfigError(f"process {jax.process_index()} holds non-contiguous batch rows; check the mesh layout")
    return start, stop


def evaluate(eval_step, params, batches: list[dict], mesh, rules, shape) -> dict[str, float]:
    """Held-out perplexity and accuracies over the fixed eval set."""
    total: dict[str, np.ndarray] = {}
    for b in batches:
        sums = eval_step(params, _global_batch(b, mesh, rules, shape))
        for k, v in sums.items():
            total[k] = total.get(k, 0) + np.asarray(v, np.float64)
    tokens = max(float(total["tokens"]), 1.0)
    out = {"eval/nll": float(total["nll"]) / tokens, "eval/accuracy": float(total["correct"]) / tokens}
    out["eval/perplexity"] = math.exp(min(out["eval/nll"], 50.0))
    if "mtp_correct" in total:
        mt = np.maximum(total["mtp_tokens"], 1.0)
        for k, (c, n) in enumerate(zip(total["mtp_correct"] / mt, total["mtp_nll"] / mt)):
            out[f"eval/mtp_accuracy/{k + 1}"] = float(c)
            out[f"eval/mtp_nll/{k + 1}"] = float(n)
    return out


def _initial_state(
    cfg: Config, mesh, rules, checkpointer: TrainCheckpointer, data, run_config: dict, echo: Callable[[str], None]
) -> tuple[Any, int, dict[str, Any]]:
    """(state, first step, `init` record): the stage's latest good checkpoint (with the data
    position), else the parameters of `train.init_from` (a previous stage's checkpoint, a Hugging
    Face or a `convert --to-orbax` directory: hf/init_from.py) with a fresh optimiser, else a
    fresh state."""
    t = cfg.train
    if t.lora.enabled:
        raise ConfigError(
            f"train.lora.rank={t.lora.rank}: adapters are trained by the RL learner (composer-jax rl) only; "
            f"a pretraining or SFT stage accepts train.lora.rank=0 (docs/rl.md, LoRA)"
        )
    if checkpointer.latest_step() is not None:
        restored = checkpointer.restore(abstract_train_state(cfg, mesh, rules), config=run_config)
        if restored.data_state is not None:
            data.set_state(restored.data_state)
        where = checkpointer.step_dir(restored.step)
        echo(f"[{t.stage}] resumed from step {restored.step} ({where})")
        return restored.train_state, restored.step, {"kind": "resume", "path": str(where), "step": restored.step}
    if t.init_from:
        params, record = load_init_params(cfg, mesh, rules, run_config)
        echo(f"[{t.stage}] initialised from {describe_init(record)}")
        return init_train_state(cfg, mesh, rules, params), 0, record
    return init_train_state(cfg, mesh, rules), 0, fresh_record(cfg)


def source_names(sources: Sequence[SourceConfig]) -> list[str]:
    """Each data source's name in the per-source metrics (`source_nll/NAME`): its `name`, else its
    file's stem, made unique by its position where two would read the same."""
    names = [s.name or Path(s.path).stem or s.type for s in sources]
    return [f"{n}.{i + 1}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def _named_sources(values: dict[str, float], names: Sequence[str]) -> dict[str, float]:
    """`source_nll/i` and `source_tokens/i` (i = 1 + the source's index) renamed by source name; a
    source with no target token in the step has no nll (not a 0)."""
    out = {}
    for k, v in values.items():
        head, _, index = k.partition("/")
        if head in ("source_nll", "source_tokens") and index.isdigit():
            if head == "source_nll" and not values.get(f"source_tokens/{index}"):
                continue
            k = f"{head}/{names[int(index) - 1]}"
        out[k] = v
    return out


def _stage_data(cfg: Config, mesh, rules) -> tuple[Any, Any]:
    """(this process's training iterator, the held-out batches): each process reads the shards of
    the batch rows it holds; the held-out batches are stacked to the same count on every process."""
    t = cfg.train
    n_shards = shard_count(cfg.data, jax.process_count())
    shards = host_shards(*_host_rows(mesh, rules, (t.batch_size, t.seq_len)), t.batch_size, n_shards)
    data = make_host_iterator(
        cfg.data, seq_len=t.seq_len, global_batch=t.batch_size, seed=t.seed, shards=shards, shard_count=n_shards
    )
    per_shard_eval = host_eval_batches(
        cfg.data,
        seq_len=t.seq_len,
        global_batch=t.batch_size,
        num_batches=t.eval_batches,
        shards=shards,
        shard_count=n_shards,
    )
    n_eval = max(allgather_json(max(len(b) for b in per_shard_eval)))
    return data, stack_eval_batches(per_shard_eval, n_eval, cfg.data.tokenizer)


def _record_step(
    n: int, host: dict, summary: dict[str, Any], stage: str, echo: Callable[[str], None], names: Sequence[str]
) -> None:
    """Step n's loss in the summary (and with a mixture each source's nll, where it had targets); a
    skipped update (non-finite loss or gradient) noted and said."""
    summary["losses"][n] = float(host["loss"])
    for name, nll, tokens in zip(names, host.get("source_nll", ()), host.get("source_tokens", ())):
        if tokens > 0:
            summary.setdefault("source_losses", {}).setdefault(name, {})[n] = float(nll)
    if host["skipped"]:
        summary["skipped_steps"].append(n)
        echo(
            f"[{stage}] step {n}: non-finite loss or gradient (loss {float(host['loss'])}, grad norm "
            f"{float(host['grad_norm'])}); the update was skipped"
        )


class _StageParts:
    """A pretraining or SFT stage's side of the trainer shell: its data, step and held-out
    evaluation, its checkpoints (with the data position), and its own summary keys: `losses`
    (per step), `source_losses` (per source and step, with a mixture), `skipped_steps`."""

    def __init__(self, cfg: Config, mesh, rules, state: Any, data, eval_batches: list[dict], cadence: Cadence):
        t = cfg.train
        self.cfg, self.mesh, self.rules, self.state, self.data = cfg, mesh, rules, state, data
        self.eval_batches, self.cadence, self.shape = eval_batches, cadence, (t.batch_size, t.seq_len)
        self.objective = pretraining_objective(len(cfg.data.sources))
        self.names = source_names(cfg.data.sources)
        self.step_fn = make_train_step(cfg, mesh, rules, objective=self.objective)
        self.eval_fn = make_eval_step(cfg, mesh, rules)
        self.peak = t.peak_tflops * 1e12 if t.peak_tflops else measure_peak_flops()
        self.lr_schedule = learning_rate_schedule(t.optimizer, t.steps)
        self.flops_per_token = flops_per_token(cfg.model, param_rows(cfg.model), t.seq_len)["total"]
        self.summary: dict[str, Any] = {"losses": {}, "skipped_steps": []}
        self.t_last = time.perf_counter()  # the last logged step's end: tokens/s over the steps since

    def parts(self, checkpointer: TrainCheckpointer, run_config: dict, echo: Callable[[str], None]) -> Parts:
        async def step(i: int) -> StepLog:
            return self.step(i, echo)

        async def evaluate(n: int) -> Evaluation:
            return self.evaluate(n)

        async def before_steps() -> None:
            self.t_last = time.perf_counter()

        return Parts(step, evaluate, lambda n, force: self.save(n, force, checkpointer, run_config), before_steps)

    def step(self, i: int, echo: Callable[[str], None]) -> StepLog:
        """Train step i on the next batch; step i + 1's values on the logged steps."""
        batch = _global_batch(next(self.data), self.mesh, self.rules, self.shape, self.objective.batch_keys)
        self.state, metrics = self.step_fn(self.state, batch)
        host = jax.device_get(metrics)
        n = i + 1
        _record_step(n, host, self.summary, self.cfg.train.stage, echo, self.names)
        if not self.cadence.logs(n):
            return StepLog({})
        now, t = time.perf_counter(), self.cfg.train
        tok_s = t.batch_size * t.seq_len * (n - max(self.cadence.start, n - t.log_every)) / max(now - self.t_last, 1e-9)
        self.t_last = now
        values = _named_sources(scalars(host), self.names)
        values.update(
            {
                "tokens_per_s": tok_s,
                "mfu": tok_s * self.flops_per_token / (self.peak * jax.device_count()),
                "lr": float(self.lr_schedule(n - 1)),
            }
        )
        line = (
            f"loss {values['loss']:.4f} nll {values['nll']:.4f} "
            f"gnorm {values['grad_norm']:.2f} {tok_s:,.0f} tok/s MFU {values['mfu']:.1%}"
        )
        return StepLog(values, line, {"expert_counts": host.get("expert_counts", [])})

    def evaluate(self, n: int) -> Evaluation:
        """Held-out perplexity (and MTP accuracies) as of step n, and its console line."""
        ev = evaluate(self.eval_fn, self.state.params, self.eval_batches, self.mesh, self.rules, self.shape)
        line = f"[{self.cfg.train.stage}] step {n} held-out perplexity {ev['eval/perplexity']:.3f}" + "".join(
            f" mtp{k.split('/')[-1]}-acc {v:.3f}" for k, v in ev.items() if "mtp_accuracy" in k
        )
        return ev, line

    def save(self, n: int, force: bool, checkpointer: TrainCheckpointer, run_config: dict) -> None:
        """Checkpoint step n with every process's data position (each holds its own shards')."""
        data_state = merge_states(allgather_json(self.data.get_state()))
        metrics = {"loss": self.summary["losses"][n]}
        checkpointer.save(n, self.state, data_state=data_state, config=run_config, metrics=metrics, force=force)


def run_stage(
    cfg: Config, *, stop_after: int | None = None, echo: Callable[[str], None] = print, mesh=None
) -> dict[str, Any]:
    """Train one stage. stop_after: return (without a final checkpoint, as a crash would) once this
    many steps have run in this call. Returns the trainer shell's summary with the per-step losses
    (`losses`, `source_losses`, `skipped_steps`), the evaluations and where the weights came from
    (`init`: hf/init_from.py's record, also the first record of metrics.jsonl)."""
    mesh = mesh if mesh is not None else make_mesh(cfg.mesh)
    cfg = resolve_model_from(cfg, mesh.devices.size)
    t = cfg.train
    rules = ShardingRules.create(cfg.sharding_rules)
    lead = jax.process_index() == 0
    if not lead:  # every process computes the same numbers: one of them prints
        echo = lambda _line: None  # noqa: E731
    run_tokenizer(cfg)
    run_config = to_dict(cfg)
    checkpointer = TrainCheckpointer(run_checkpoint_config(cfg))
    data, eval_batches = _stage_data(cfg, mesh, rules)
    state, start, init = _initial_state(cfg, mesh, rules, checkpointer, data, run_config, echo)
    cadence = Cadence(t.steps, start, t.log_every, t.eval_every)
    stage = _StageParts(cfg, mesh, rules, state, data, eval_batches, cadence)
    shell = TrainerShell(
        t.stage, cadence, checkpointer, out_dir=t.out_dir, tensorboard=t.tensorboard, lead=lead, echo=echo
    )
    shell.record_init(start, init)
    with jax.set_mesh(mesh):
        run_to_end(shell.run(stage.parts(checkpointer, run_config, echo), stop_after))
    return {**shell.close(), **stage.summary}
