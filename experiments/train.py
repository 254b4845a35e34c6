"""Train and evaluate a model on a transduction task: the loop (the layout of flax's wmt example).

  python -m experiments.train --config configs/dates.py --workdir runs/dates
  python -m experiments.train --config configs/num2words_de.py --workdir runs/x \
      --config.train.steps=2000

This module is the loop, logging, summary and the mesh; what depends on the model kind (batches,
loss, evaluation, generation, parameter layout, plots) is its runner's: experiments.seq2seq for
the Transformer, experiments.lm for the decoder-only LM (config.kind="lm"), picked by make_runner.

A killed run restarted with the same workdir resumes from its last checkpoint and ends with the
metrics an uninterrupted run would have: batches are a pure function of (seed, step) and the
dropout key of step k is fold_in(state.rng, k). A checkpoint that cannot be read (a save cut short,
a truncated folder) is skipped for the one before it (experiments.checkpoints). A restart whose
model, task or seed differ from the run's is refused, naming them, before anything is written
(experiments.run_config); train.steps (to extend a run), logging and evaluation may change.
SIGTERM (a scheduler's preemption) or SIGINT (Ctrl-C) stops the run after the current step with
that step's checkpoint saved, and the process exits with 143 or 130 (experiments.preemption);
rerun it to resume.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tqdm
from absl import app, flags, logging
from ml_collections import config_flags

from experiments import checkpoints, distributed, metrics, plots, preemption, run_config
from experiments.lm import LMRunner
from experiments.runner import Runner
from experiments.seq2seq import Seq2SeqRunner
from flax_mha import checks
from flax_mha import remat
from flax_mha.parallel import sharding
from flax_mha.parallel.seq_parallel import (length_multiple, sequence_parallel_implementation,
                                           to_layout_order)


class TrainState(flax.struct.PyTreeNode):
  step: jax.Array  # optimizer steps taken
  params: Any
  opt_state: Any
  rng: jax.Array  # raw uint32 key; step k drops out with fold_in(rng, k)


# Config keys whose bad value would ruin a run silently or late: key -> smallest allowed int.
_INT_KEYS = {
    "seed": 0, "train.steps": 1, "train.batch_size": 1, "train.warmup_steps": 0,
    "train.bucket_window": 1, "train.log_every": 1, "train.checkpoint_every": 1,
    "eval.every": 1, "eval.num_examples": 1, "eval.batch_size": 1,
    "mesh.data": 1, "mesh.model": 1, "mesh.seq": 1, "mesh.fsdp": 1,
}
# key -> the bounds of a finite float (flax_mha.checks.check_real's keywords).
_FLOAT_KEYS = {
    "train.peak_lr": dict(above=0),
    "train.weight_decay": dict(lowest=0),
    "train.label_smoothing": dict(lowest=0, below=1),
    "train.grad_clip_norm": dict(above=0),  # 0 would zero every update
}


def _get(config: ml_collections.ConfigDict, key: str):
  for name in key.split("."):
    config = config[name]
  return config


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raise a ValueError (TypeError for a wrong type) naming the first bad key of `config`.

  Catches, before anything is built or written, the values that would otherwise train nothing
  (steps <= 0), divide by zero mid-run (log_every, checkpoint_every, eval.every = 0) or train
  at a meaningless learning rate. Architecture keys are checked by the model's config, keys
  only one model kind reads by its runner (make_runner).
  """
  for key, lowest in _INT_KEYS.items():
    checks.check_int(f"config.{key}", _get(config, key), lowest)
  for key, bounds in _FLOAT_KEYS.items():
    checks.check_real(f"config.{key}", _get(config, key), **bounds)
  remat.check_policy("config.train.remat", config.train.remat)
  schedule = _schedule_name(config.train)
  if schedule not in SCHEDULES:
    raise ValueError(f"config.train.schedule must be one of {tuple(SCHEDULES)}, got {schedule!r}")
  buckets = config.train.length_buckets
  if not buckets or not all(isinstance(b, int) and b >= 1 for b in buckets):
    raise ValueError(
        f"config.train.length_buckets must be a non-empty sequence of positive ints, got {buckets}")
  for key in ("seq_strategy", "seq_layout"):
    if key not in config.mesh:
      raise ValueError(f"config.mesh.{key} is missing (configs/common.py sets it)")
  try:
    sequence_parallel_implementation(config.mesh.seq_strategy, config.mesh.seq_layout)
  except ValueError as e:
    raise ValueError(f"config.mesh.seq_strategy / seq_layout: {e}") from None


def _warmup(warmup_steps: int) -> int:
  if warmup_steps < 0:
    raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
  return max(warmup_steps, 1)  # step 1 is the first: a 0-step warm-up ends there too


def _step(count):
  """optax's count (step - 1) as the 1-based step, float32."""
  return jnp.maximum(count + 1, 1).astype(jnp.float32)


def learning_rate_schedule(peak_lr: float, warmup_steps: int):
  """The paper's schedule scaled to `peak_lr`: linear warm-up, then decay as 1/sqrt(step).

  Step n (1-based; optax passes the count n - 1) trains at peak_lr * min(n / w, sqrt(w / n)) with
  w = max(warmup_steps, 1): it rises linearly to peak_lr at step w, then falls as 1/sqrt(n).
  warmup_steps=0 means no warm-up and equals warmup_steps=1: peak_lr at step 1, peak_lr / sqrt(n)
  at step n.
  """
  warmup = _warmup(warmup_steps)

  def schedule(count):
    step = _step(count)
    return peak_lr * jnp.minimum(step / warmup, jnp.sqrt(warmup / step))
  return schedule


def cosine_schedule(peak_lr: float, warmup_steps: int, steps: int):
  """Linear warm-up to peak_lr at step w = max(warmup_steps, 1), then a cosine to 0 at step
  `steps` (train.steps): a short run ends at a small learning rate, where the rsqrt decay
  would still be at peak_lr·sqrt(w / steps). Extending a run's train.steps on resume
  stretches the cosine of the steps still to come."""
  warmup = _warmup(warmup_steps)

  def schedule(count):
    step = _step(count)
    done = jnp.clip((step - warmup) / max(steps - warmup, 1), 0.0, 1.0)
    return peak_lr * jnp.minimum(step / warmup, 0.5 * (1.0 + jnp.cos(jnp.pi * done)))
  return schedule


# config.train.schedule -> the learning rate's schedule from the train config.
SCHEDULES = {
    "rsqrt": lambda train: learning_rate_schedule(train.peak_lr, train.warmup_steps),
    "cosine": lambda train: cosine_schedule(train.peak_lr, train.warmup_steps, train.steps),
}


def _schedule_name(train: ml_collections.ConfigDict) -> str:
  """train.schedule; "rsqrt" for a run saved before the key existed (its config.json)."""
  return train.get("schedule", "rsqrt")


def make_optimizer(train: ml_collections.ConfigDict) -> optax.GradientTransformation:
  return optax.chain(
      optax.clip_by_global_norm(train.grad_clip_norm),
      optax.adamw(SCHEDULES[_schedule_name(train)](train), b1=0.9, b2=0.98,
                  eps=1e-9, weight_decay=train.weight_decay))


RUNNERS = {"seq2seq": Seq2SeqRunner, "lm": LMRunner}


def make_runner(config: ml_collections.ConfigDict) -> Runner:
  """The runner of config.kind: "seq2seq" (the default) or "lm" (configs/lm.py). The one place
  that tells the model kinds apart; a runner checks the config keys only its kind reads."""
  kind = config.get("kind", "seq2seq")
  if kind not in RUNNERS:
    raise ValueError(f"config.kind must be one of {sorted(RUNNERS)}, got {kind!r}")
  return RUNNERS[kind](config)


def train_step(state: TrainState, batch, *, runner: Runner, model, tx, label_smoothing: float):
  """One optimizer step of `model` (the runner's, or its ring-attention twin) on `batch`."""
  dropout_rng = jax.random.fold_in(state.rng, state.step)

  def loss_fn(params):
    logits = model.apply({"params": params}, *runner.inputs(batch), train=True,
                         rngs={"dropout": dropout_rng})
    loss, correct, count = runner.loss_terms(logits, batch, label_smoothing)
    return loss / count, (correct, count)

  (loss, (correct, count)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  new_state = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                            opt_state=opt_state)
  return new_state, {"loss": loss, "token_accuracy": correct / count,
                     "grad_norm": optax.global_norm(grads)}


def init_state(runner: Runner, tx) -> TrainState:
  param_rng, dropout_rng, train_rng = jax.random.split(jax.random.PRNGKey(runner.config.seed), 3)
  params = jax.jit(runner.model.init)({"params": param_rng, "dropout": dropout_rng},
                                      *runner.inputs(runner.init_batch()))["params"]
  return TrainState(step=jnp.array(0, jnp.int32), params=params, opt_state=tx.init(params),
                    rng=train_rng)


def shard_and_compile(runner: Runner, state: TrainState, tx):
  """`state` laid out on the config's (data, fsdp, model, seq) mesh, and the jitted step for it.

  Parameters and Adam moments follow the model's declared axes (runner.param_axes), and with
  fsdp > 1 are split over 'fsdp' too (flax_mha.parallel.sharding); batches are split over 'data' (x
  'fsdp'); with seq > 1 the training model's attention is sequence-parallel over 'seq' by
  mesh.seq_strategy in mesh.seq_layout, and it recomputes what config.train.remat says
  (evaluation and decoding use the model as configured). A runner whose model is token-order
  free (the LM) gets each batch permuted once into the layout's order on the host, so no layer
  moves tokens between devices. A mesh of size 1 is the single-device run; the same seed gives
  the same losses on any mesh.
  """
  config, model = runner.config, runner.model
  mesh_cfg = config.mesh
  if config.train.batch_size % (mesh_cfg.data * mesh_cfg.fsdp):
    raise ValueError(f"train.batch_size={config.train.batch_size} must be a multiple of "
                     f"mesh.data={mesh_cfg.data} x mesh.fsdp={mesh_cfg.fsdp}")
  multiple = length_multiple(mesh_cfg.seq_layout, mesh_cfg.seq)
  lengths = config.train.get("length") or config.train.length_buckets  # the LM packs rows
  if any(length % multiple for length in np.atleast_1d(lengths)):
    raise ValueError(f"train.{'length' if config.train.get('length') else 'length_buckets'}="
                     f"{lengths} must be multiples of {multiple} (mesh.seq={mesh_cfg.seq}, "
                     f"mesh.seq_layout={mesh_cfg.seq_layout!r})")
  distributed.check_mesh_covers_devices(
      mesh_cfg.data * mesh_cfg.fsdp * mesh_cfg.model * mesh_cfg.seq)
  mesh = sharding.make_mesh(data=mesh_cfg.data, fsdp=mesh_cfg.fsdp, model=mesh_cfg.model,
                            seq=mesh_cfg.seq)
  permute = mesh_cfg.seq > 1 and runner.token_order_free  # the batch once, not every layer
  if mesh_cfg.seq > 1:
    implementation = sequence_parallel_implementation(
        mesh_cfg.seq_strategy, mesh_cfg.seq_layout, "in_layout" if permute else "natural")
    model = type(model)(dataclasses.replace(model.config,
                                            attention_implementation=implementation))
  if config.train.remat != "none":
    model = type(model)(dataclasses.replace(model.config, remat=config.train.remat))
  param_axes = runner.param_axes + ((r"(^|/)rng$", (None,)),)  # the state's raw key
  state = sharding.shard_params(state, mesh, param_axes)
  state_shardings = sharding.shardings_for(state, mesh, param_axes)
  jitted = jax.jit(functools.partial(train_step, runner=runner, model=model, tx=tx,
                                     label_smoothing=config.train.label_smoothing),
                   in_shardings=(state_shardings, sharding.batch_sharding(mesh, ndim=2)),
                   out_shardings=(state_shardings, None), donate_argnums=0)
  return state, StepFn(jitted, mesh, mesh_cfg.seq_layout if permute else None)


@dataclasses.dataclass(frozen=True)
class StepFn:
  """The jitted training step on its mesh: `step_fn(state, host batch) -> (state, metrics)`."""
  jitted: Any
  mesh: jax.sharding.Mesh
  layout: str | None  # the token layout host batches are permuted into (None: as they come)

  def __call__(self, state, batch):
    if self.layout:  # on the host: every [B, L] array of the batch in the layout's token order
      batch = {name: to_layout_order(x, self.layout, self.mesh.shape[sharding.SEQ_AXIS])
               for name, x in batch.items()}
    # With several processes, each hands over the rows its devices hold.
    batch = distributed.global_batch(batch, sharding.batch_sharding(self.mesh, ndim=2))
    return self._in_mesh(self.jitted, state, batch)

  def lower(self, state, batch):
    """The step lowered for `state` and `batch` (arrays or jax.ShapeDtypeStruct; the layout's
    permutation moves no shape, so none is applied), e.g. to compile and read its memory."""
    return self._in_mesh(self.jitted.lower, state, batch)

  def _in_mesh(self, fn, state, batch):
    with jax.set_mesh(self.mesh):  # sequence-parallel attention finds its mesh here when traced
      return fn(state, batch)


def train_loop(runner: Runner, state: TrainState, train_seconds: float, step_fn, manager,
               writer: metrics.MetricWriter, stop: preemption.StopSignal | None = None):
  """Steps state.step + 1 .. config.train.steps with logging, evaluation and checkpoints.

  Returns (state, train_seconds, last evaluation metrics or {} when no step was left).
  train_seconds counts training only (compilation included), not evaluation or checkpoints.
  When `stop` agrees to stop after a step before the last, that step is finished as usual (its
  rows, so a resumed run writes the rows an uninterrupted one would), saved, and
  preemption.Preempted is raised.
  """
  config = runner.config
  steps = config.train.steps
  eval_metrics, window_tokens, window_start = {}, 0, time.perf_counter()
  with tqdm.tqdm(total=steps, initial=int(state.step), desc=runner.task.name, unit="step",
                 disable=not distributed.is_primary()) as bar:
    for step in range(int(state.step) + 1, steps + 1):
      batch = runner.train_batch(step - 1)
      window_tokens += runner.num_tokens(batch)
      state, train_metrics = step_fn(state, batch)
      bar.update()
      log = step % config.train.log_every == 0 or step == steps
      evaluate = step % config.eval.every == 0 or step == steps
      stopping = stop is not None and stop.agreed() and step < steps  # every process, every step
      save = step % config.train.checkpoint_every == 0 or step == steps or stopping
      if not (log or evaluate or save):
        continue
      train_metrics = jax.device_get(train_metrics)  # waits for the step: timings are honest
      elapsed = time.perf_counter() - window_start
      train_seconds += elapsed
      postfix = {"loss": f"{train_metrics['loss']:.4f}"}
      if log:
        row = {f"train/{k}": float(v) for k, v in train_metrics.items()}
        row["train/tokens_per_second"] = window_tokens / elapsed
        writer.write(step, row)
        postfix["tok/s"] = f"{window_tokens / elapsed:.0f}"
        window_tokens = 0
      if evaluate:
        eval_metrics = runner.evaluate(distributed.local(state.params))
        writer.write(step, eval_metrics)
        postfix["exact"] = f"{eval_metrics['eval/exact_match']:.3f}"
      if save:
        checkpoints.save(manager, step, state, train_seconds, config)
      if stopping:  # the manager's exit waits for the save
        raise preemption.Preempted(stop.signum, step)
      bar.set_postfix(postfix)
      window_start = time.perf_counter()
  return state, train_seconds, eval_metrics


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Train (resuming from <workdir>'s last checkpoint), evaluate, plot; return the summary.

  Raises run_config.ConfigMismatch, with the workdir as it was, if <workdir> holds a run whose
  model, task or seed differ from `config`'s (experiments.run_config), and preemption.Preempted
  after a SIGTERM or SIGINT during training, the step it stopped after saved.
  """
  check_config(config)
  runner = make_runner(config)
  workdir = os.path.abspath(workdir)
  run_config.check_resume(workdir, config)
  os.makedirs(workdir, exist_ok=True)
  tx = make_optimizer(config.train)
  state, step_fn = shard_and_compile(runner, init_state(runner, tx), tx)
  primary = distributed.is_primary()  # with several processes, the one that writes files
  with checkpoints.open_manager(workdir) as manager:
    state, train_seconds = checkpoints.restore_newest_readable(
        manager, state, os.path.join(workdir, checkpoints.UNREADABLE_DIR), config)
    if primary:
      run_config.write(workdir, config)  # for experiments.generate
    writer = (metrics.MetricWriter(workdir, resume_step=int(state.step)) if primary
              else metrics.NoWriter())
    try:
      with preemption.StopSignal() as stop:
        state, train_seconds, eval_metrics = train_loop(
            runner, state, train_seconds, step_fn, manager, writer, stop)
    finally:
      writer.close()
  params = distributed.local(state.params)
  if not eval_metrics:  # restarted after the last step: report the restored state
    eval_metrics = runner.evaluate(params)
  summary = {
      "task": runner.task.name,
      "steps": int(state.step),
      "train_seconds": train_seconds,
      "steps_per_second": int(state.step) / train_seconds if train_seconds else None,
      "params": int(sum(x.size for x in jax.tree.leaves(state.params))),
      **{"eval_" + k.removeprefix("eval/"): v for k, v in eval_metrics.items()},
  }
  if primary:
    plots.learning_curves(metrics.read_rows(workdir),
                          os.path.join(workdir, "learning_curves.png"))
    runner.finish(params, workdir)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
  distributed.barrier("summary written")  # no process leaves before the files are there
  return summary


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  try:
    distributed.initialize(auto=flags.FLAGS.distributed)
    summary = train_and_evaluate(flags.FLAGS.config, flags.FLAGS.workdir)
  except (run_config.ConfigMismatch, distributed.SetupError) as e:
    sys.exit(f"error: {e}")  # the reason alone: no traceback to read it in
  except preemption.Preempted as e:
    if distributed.is_primary():
      print(e, file=sys.stderr, flush=True)
    sys.exit(e.exit_code)
  if distributed.is_primary():
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":  # flags only here: importing this module defines none
  config_flags.DEFINE_config_file(
      "config", None, "experiment config: configs/<name>.py[:arg]", lock_config=True)
  flags.DEFINE_string("workdir", None, "directory for checkpoints, metrics and plots")
  flags.DEFINE_bool("distributed", False, "join JAX's distributed runtime found from the cluster "
                    "environment (SLURM, Cloud TPU): jax.distributed.initialize()")
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main)
