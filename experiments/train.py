"""Train and evaluate a Transformer on a transduction task (the layout of flax's wmt example).

  python -m experiments.train --config configs/dates.py --workdir runs/dates
  python -m experiments.train --config configs/num2words_de.py --workdir runs/x \
      --config.train.steps=2000

A killed run restarted with the same workdir resumes from its last checkpoint and ends with the
metrics an uninterrupted run would have: batches are a pure function of (seed, step) and the
dropout key of step k is fold_in(state.rng, k). A checkpoint that cannot be read (a save cut short,
a truncated folder) is skipped for the one before it and moved to <workdir>/checkpoints_unreadable.
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
import orbax.checkpoint as ocp
import sacrebleu
import tqdm
from absl import app, flags, logging
from ml_collections import config_flags

from experiments import data, lm, metrics, plots
from experiments.losses import cross_entropy
from experiments.tasks import BOS, EOS, PAD, Task, get_task
from flax_mha import checks
from flax_mha import sharding
from flax_mha.models.decoding import greedy_decode
# The module's function (flax_mha re-exports the name ring_attention for another function).
from flax_mha.kernels.ring import attention as ring_implementation
from flax_mha.models import lm as lm_model
from flax_mha.models import transformer
from flax_mha.models.lm import DecoderLM
from flax_mha.models.transformer import Transformer, TransformerConfig


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
    "mesh.data": 1, "mesh.model": 1, "mesh.seq": 1,
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
  at a meaningless learning rate. Architecture keys are checked by the model's config.
  """
  for key, lowest in _INT_KEYS.items():
    checks.check_int(f"config.{key}", _get(config, key), lowest)
  for key, bounds in _FLOAT_KEYS.items():
    checks.check_real(f"config.{key}", _get(config, key), **bounds)
  buckets = config.train.length_buckets
  if not buckets or not all(isinstance(b, int) and b >= 1 for b in buckets):
    raise ValueError(
        f"config.train.length_buckets must be a non-empty sequence of positive ints, got {buckets}")
  if is_lm(config) and config.mesh.seq > 1:
    raise ValueError(
        f"config.mesh.seq={config.mesh.seq}: the LM's packed documents (segment ids) cannot be "
        "split over a sequence mesh yet (ring attention takes no segment ids); use mesh.seq=1 "
        "and mesh.data / mesh.model")


def model_config(config: ml_collections.ConfigDict, task: Task) -> TransformerConfig:
  return TransformerConfig(vocab_size=task.vocab.size, pad_id=PAD, bos_id=BOS, eos_id=EOS,
                           **config.model)


def learning_rate_schedule(peak_lr: float, warmup_steps: int):
  """The paper's schedule scaled to `peak_lr`: linear warm-up, then decay as 1/sqrt(step).

  Step n (1-based; optax passes the count n - 1) trains at peak_lr * min(n / w, sqrt(w / n)) with
  w = max(warmup_steps, 1): it rises linearly to peak_lr at step w, then falls as 1/sqrt(n).
  warmup_steps=0 means no warm-up and equals warmup_steps=1: peak_lr at step 1, peak_lr / sqrt(n)
  at step n.
  """
  if warmup_steps < 0:
    raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
  warmup = max(warmup_steps, 1)  # step 1 is the first: a 0-step warm-up ends there too

  def schedule(count):
    step = jnp.maximum(count + 1, 1).astype(jnp.float32)
    return peak_lr * jnp.minimum(step / warmup, jnp.sqrt(warmup / step))
  return schedule


def make_optimizer(train: ml_collections.ConfigDict) -> optax.GradientTransformation:
  return optax.chain(
      optax.clip_by_global_norm(train.grad_clip_norm),
      optax.adamw(learning_rate_schedule(train.peak_lr, train.warmup_steps), b1=0.9, b2=0.98,
                  eps=1e-9, weight_decay=train.weight_decay))


def is_lm(config) -> bool:
  """Whether the config trains the decoder-only LM (configs/lm.py) rather than the Transformer."""
  return config.get("kind", "seq2seq") == "lm"


def make_model(config, task: Task):
  if is_lm(config):
    return DecoderLM(lm.model_config(config, task))
  return Transformer(model_config(config, task))


def model_param_axes(config):
  """The logical axes the model declares for its parameters (flax_mha.sharding)."""
  return lm_model.PARAM_AXES if is_lm(config) else transformer.PARAM_AXES


def model_inputs(batch) -> tuple:
  """The model's positional inputs: (src, tgt_in), or the LM's (tokens, segment_ids, positions)."""
  if "tokens" in batch:
    return batch["tokens"], batch["segment_ids"], batch["positions"]
  return batch["src"], batch["tgt_in"]


def loss_terms(logits, batch, label_smoothing: float):
  """cross_entropy over what the batch scores: the target tokens, or the LM's answer tokens."""
  if "tokens" in batch:
    return lm.loss_terms(logits, batch, label_smoothing)
  return cross_entropy(logits, batch["tgt_out"], label_smoothing)


def next_batch(config, task: Task, step: int):
  """Training batch `step` (0-based) of either model: a pure function of (seed, step), its
  token ids checked against the vocabulary (inside jit a bad id would be a silent NaN)."""
  if is_lm(config):
    batch = lm.train_batch(config, task, step)
  else:
    batch = data.train_batch(task, config.seed, step, config.train.batch_size,
                             config.train.bucket_window, config.train.length_buckets)
  for name in ("src", "tgt_in", "tgt_out", "tokens", "targets"):
    if name in batch:
      checks.check_token_ids(f"batch {step} {name}", batch[name], task.vocab.size)
  return batch


def num_tokens(batch) -> int:
  """Real (non-pad) input tokens of a batch: src + tgt_in, or the LM's tokens."""
  names = ("tokens",) if "tokens" in batch else ("src", "tgt_in")
  return int(sum(np.sum(batch[name] != PAD) for name in names))


def train_step(state: TrainState, batch, *, model, tx, label_smoothing: float):
  dropout_rng = jax.random.fold_in(state.rng, state.step)

  def loss_fn(params):
    logits = model.apply({"params": params}, *model_inputs(batch), train=True,
                         rngs={"dropout": dropout_rng})
    loss, correct, count = loss_terms(logits, batch, label_smoothing)
    return loss / count, (correct, count)

  (loss, (correct, count)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  new_state = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                            opt_state=opt_state)
  return new_state, {"loss": loss, "token_accuracy": correct / count,
                     "grad_norm": optax.global_norm(grads)}


def eval_step(params, batch, *, model):
  logits = model.apply({"params": params}, batch["src"], batch["tgt_in"])
  return cross_entropy(logits, batch["tgt_out"], 0.0)


class Evaluator:
  """Held-out metrics: teacher-forced loss/token accuracy, greedy exact match, BLEU/chrF."""

  def __init__(self, config, task: Task, model, cfg: TransformerConfig):
    self.task = task
    self.pairs, self.batches = data.eval_batches(
        task, config.seed, config.eval.num_examples, config.eval.batch_size,
        config.train.length_buckets)
    self._eval_step = jax.jit(functools.partial(eval_step, model=model))
    max_len = self.batches[0]["tgt_out"].shape[1]
    self._decode = jax.jit(lambda params, src: greedy_decode(cfg, params, src, max_len=max_len))

  def decode(self, params) -> list[str]:
    """Greedy decodings of the held-out sources, in order."""
    tokens = [np.asarray(self._decode(params, b["src"])) for b in self.batches]
    return [self.task.vocab.decode(row) for row in np.concatenate(tokens)][:len(self.pairs)]

  def __call__(self, params) -> dict[str, float]:
    sums = np.sum([jax.device_get(self._eval_step(params, b)) for b in self.batches], axis=0)
    loss, correct, count = sums
    hyps = self.decode(params)
    refs = [t for _, t in self.pairs]
    out = {"eval/loss": float(loss / count), "eval/token_accuracy": float(correct / count),
           "eval/exact_match": float(np.mean([h == r for h, r in zip(hyps, refs)]))}
    if self.task.text_target:
      out["eval/bleu"] = sacrebleu.corpus_bleu(hyps, [refs]).score
      out["eval/chrf"] = sacrebleu.corpus_chrf(hyps, [refs]).score
    return out


def _labels(text: str) -> list[str]:
  return ["␣" if c == " " else c for c in text]


def plot_attention(model, params, task: Task, src: str, hyp: str, workdir: str) -> None:
  """Cross-attention (last decoder layer) and encoder self-attention (last layer) per head."""
  src_ids = np.array([task.vocab.encode(src)], np.int32)
  tgt_in = np.array([[BOS, *task.vocab.encode(hyp)]], np.int32)
  _, state = model.apply({"params": params}, src_ids, tgt_in, sow_weights=True,
                         mutable=["intermediates"])
  inter = flax.traverse_util.flatten_dict(state["intermediates"], sep="/")

  def last(kind: str) -> np.ndarray:
    name = max(k for k in inter if kind in k and "attention_weights" in k)
    return np.asarray(inter[name][0])[0]  # sown as a 1-tuple; batch element 0 -> [H, T, S]

  plots.attention_maps(last("cross_attention"), _labels(hyp) + ["</s>"], _labels(src),
                       f"cross-attention: {src!r} -> {hyp!r}",
                       os.path.join(workdir, "cross_attention.png"))
  plots.attention_maps(last("encoder"), _labels(src), _labels(src),
                       f"encoder self-attention: {src!r}",
                       os.path.join(workdir, "encoder_self_attention.png"))


def _checkpoint_args(state, train_seconds=None):
  if train_seconds is None:  # restore: `state` is the target
    return ocp.args.Composite(state=ocp.args.StandardRestore(state), meta=ocp.args.JsonRestore())
  return ocp.args.Composite(state=ocp.args.StandardSave(state),
                            meta=ocp.args.JsonSave({"train_seconds": train_seconds}))


UNREADABLE_DIR = "checkpoints_unreadable"  # in the workdir: checkpoints a restart skipped


def _first_line(error: Exception, limit: int = 200) -> str:
  text = str(error).strip().split("\n")[0]
  text = text if len(text) <= limit else text[:limit] + "..."
  return f"{type(error).__name__}: {text}"


def _set_aside(path: str, aside_dir: str) -> str:
  """Move `path` into `aside_dir` under a name not yet taken; return the new path."""
  os.makedirs(aside_dir, exist_ok=True)
  dest = base = os.path.join(aside_dir, os.path.basename(path))
  n = 1
  while os.path.exists(dest):
    dest, n = f"{base}.{n}", n + 1
  os.rename(path, dest)
  return dest


def restore_newest_readable(manager, state: TrainState, aside_dir: str):
  """(state, train_seconds) from the newest checkpoint that restores; (state, 0.0) if none exist.

  A run killed while saving, or a folder emptied or truncated later, leaves a checkpoint that
  cannot be read. Restarts skip it for the next older one and move it into `aside_dir` (kept
  for inspection): otherwise orbax, which never saves a step at or below its newest one, would
  keep the broken folder in place of the new save. Prints one line per skipped checkpoint.
  Raises RuntimeError naming the checkpoint directory when checkpoints exist but none restores.
  """
  skipped = []
  for step in sorted(manager.all_steps(), reverse=True):
    path = os.path.join(str(manager.directory), str(step))
    try:
      restored = manager.restore(step, args=_checkpoint_args(state))
    except Exception as e:  # broad: orbax raises a bare Exception for corrupt array data
      skipped.append((path, _first_line(e)))
      continue
    for bad_path, reason in skipped:
      dest = _set_aside(bad_path, aside_dir)
      print(f"skipped unreadable checkpoint {bad_path} ({reason}); moved to {dest}",
            file=sys.stderr, flush=True)
    if skipped:
      manager.reload()  # forget the moved steps, so that the run saves them afresh
    return restored.state, restored.meta["train_seconds"]
  if skipped:
    details = "; ".join(f"{path}: {reason}" for path, reason in skipped)
    raise RuntimeError(
        f"no readable checkpoint in {manager.directory} (each failed to restore; a changed model "
        f"config also causes this): {details}. Move that directory away to train from scratch.")
  return state, 0.0


def init_state(config, task: Task, model, tx) -> TrainState:
  param_rng, dropout_rng, train_rng = jax.random.split(jax.random.PRNGKey(config.seed), 3)
  if is_lm(config):
    example = lm.init_batch(config, task)
  else:
    example = data.train_batch(task, config.seed, 0, 2, 1, config.train.length_buckets)
  params = jax.jit(model.init)({"params": param_rng, "dropout": dropout_rng},
                               *model_inputs(example))["params"]
  return TrainState(step=jnp.array(0, jnp.int32), params=params, opt_state=tx.init(params),
                    rng=train_rng)


def shard_and_compile(config, state: TrainState, model, tx):
  """`state` laid out on the config's (data, model, seq) mesh, and the jitted step for it.

  Parameters and Adam moments follow flax_mha.sharding's tables; batches are split over 'data';
  with seq > 1 the training model's attention is ring attention over 'seq' (evaluation and
  decoding use the model as configured). A 1 x 1 x 1 mesh is the single-device run; the same
  seed gives the same losses on any mesh.
  """
  mesh_cfg = config.mesh
  if config.train.batch_size % mesh_cfg.data:
    raise ValueError(f"train.batch_size={config.train.batch_size} must be a multiple of "
                     f"mesh.data={mesh_cfg.data}")
  if any(length % mesh_cfg.seq for length in config.train.length_buckets):
    raise ValueError(f"train.length_buckets={tuple(config.train.length_buckets)} must be "
                     f"multiples of mesh.seq={mesh_cfg.seq}")
  mesh = sharding.make_mesh(data=mesh_cfg.data, model=mesh_cfg.model, seq=mesh_cfg.seq)
  if mesh_cfg.seq > 1:
    model = type(model)(dataclasses.replace(model.config,
                                            attention_implementation=ring_implementation))
  param_axes = model_param_axes(config) + ((r"(^|/)rng$", (None,)),)  # the state's raw key
  state = sharding.shard_params(state, mesh, param_axes)
  state_shardings = sharding.shardings_for(state, mesh, param_axes)
  jitted = jax.jit(functools.partial(train_step, model=model, tx=tx,
                                     label_smoothing=config.train.label_smoothing),
                   in_shardings=(state_shardings, sharding.batch_sharding(mesh, ndim=2)),
                   out_shardings=(state_shardings, None), donate_argnums=0)

  def step_fn(state, batch):
    with jax.set_mesh(mesh):  # ring attention finds its mesh here when the step is traced
      return jitted(state, batch)

  return state, step_fn


def train_loop(config, task: Task, state: TrainState, train_seconds: float, step_fn,
               evaluator: Evaluator, manager, writer: metrics.MetricWriter):
  """Steps state.step + 1 .. config.train.steps with logging, evaluation and checkpoints.

  Returns (state, train_seconds, last evaluation metrics or {} when no step was left).
  train_seconds counts training only (compilation included), not evaluation or checkpoints.
  """
  steps = config.train.steps
  eval_metrics, window_tokens, window_start = {}, 0, time.perf_counter()
  with tqdm.tqdm(total=steps, initial=int(state.step), desc=task.name, unit="step") as bar:
    for step in range(int(state.step) + 1, steps + 1):
      batch = next_batch(config, task, step - 1)
      window_tokens += num_tokens(batch)
      state, train_metrics = step_fn(state, batch)
      bar.update()
      log = step % config.train.log_every == 0 or step == steps
      evaluate = step % config.eval.every == 0 or step == steps
      save = step % config.train.checkpoint_every == 0 or step == steps
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
        eval_metrics = evaluator(state.params)
        writer.write(step, eval_metrics)
        postfix["exact"] = f"{eval_metrics['eval/exact_match']:.3f}"
      if save:
        manager.save(step, args=_checkpoint_args(state, train_seconds))
      bar.set_postfix(postfix)
      window_start = time.perf_counter()
  return state, train_seconds, eval_metrics


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Train (resuming from <workdir>'s last checkpoint), evaluate, plot; return the summary."""
  check_config(config)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  task = get_task(config.task.name, **config.task.kwargs)
  model = make_model(config, task)
  tx = make_optimizer(config.train)
  state = init_state(config, task, model, tx)
  if is_lm(config):
    evaluator = lm.Evaluator(config, task, model)
  else:
    evaluator = Evaluator(config, task, model, model.config)
  state, step_fn = shard_and_compile(config, state, model, tx)
  options = ocp.CheckpointManagerOptions(max_to_keep=2)
  with ocp.CheckpointManager(os.path.join(workdir, "checkpoints"), options=options) as manager:
    state, train_seconds = restore_newest_readable(
        manager, state, os.path.join(workdir, UNREADABLE_DIR))
    writer = metrics.MetricWriter(workdir, resume_step=int(state.step))
    try:
      state, train_seconds, eval_metrics = train_loop(
          config, task, state, train_seconds, step_fn, evaluator, manager, writer)
    finally:
      writer.close()
  if not eval_metrics:  # restarted after the last step: report the restored state
    eval_metrics = evaluator(state.params)

  plots.learning_curves(metrics.read_rows(workdir), os.path.join(workdir, "learning_curves.png"))
  if not is_lm(config):
    plot_attention(model, state.params, task, evaluator.pairs[0][0],
                   evaluator.decode(state.params)[0], workdir)
  summary = {
      "task": task.name,
      "steps": int(state.step),
      "train_seconds": train_seconds,
      "steps_per_second": int(state.step) / train_seconds if train_seconds else None,
      "params": int(sum(x.size for x in jax.tree.leaves(state.params))),
      **{"eval_" + k.removeprefix("eval/"): v for k, v in eval_metrics.items()},
  }
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  return summary


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  summary = train_and_evaluate(flags.FLAGS.config, flags.FLAGS.workdir)
  print(json.dumps(summary, indent=2))


if __name__ == "__main__":  # flags only here: importing this module defines none
  config_flags.DEFINE_config_file(
      "config", None, "experiment config: configs/<name>.py[:arg]", lock_config=True)
  flags.DEFINE_string("workdir", None, "directory for checkpoints, metrics and plots")
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main)
