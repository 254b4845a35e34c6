"""Train and evaluate a Transformer on a transduction task (the layout of flax's wmt example).

  python -m experiments.train --config configs/dates.py --workdir runs/dates
  python -m experiments.train --config configs/num2words_de.py --workdir runs/x \
      --config.train.steps=2000

A killed run restarted with the same workdir resumes from its last checkpoint and ends with the
metrics an uninterrupted run would have: batches are a pure function of (seed, step) and the
dropout key of step k is fold_in(state.rng, k).
"""

from __future__ import annotations

import functools
import json
import os
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

from experiments import data, metrics, plots
from experiments.tasks import BOS, EOS, PAD, Task, get_task
from flax_mha import ring_implementation, sharding
from flax_mha.decoding import greedy_decode
from flax_mha.transformer import Transformer, TransformerConfig


class TrainState(flax.struct.PyTreeNode):
  step: jax.Array  # optimizer steps taken
  params: Any
  opt_state: Any
  rng: jax.Array  # raw uint32 key; step k drops out with fold_in(rng, k)


def model_config(config: ml_collections.ConfigDict, task: Task) -> TransformerConfig:
  return TransformerConfig(vocab_size=task.vocab.size, pad_id=PAD, bos_id=BOS, eos_id=EOS,
                           **config.model)


def learning_rate_schedule(peak_lr: float, warmup_steps: int):
  """The paper's schedule scaled to `peak_lr`: linear warm-up, then decay as 1/sqrt(step)."""
  def schedule(count):
    step = jnp.maximum(count + 1, 1).astype(jnp.float32)
    return peak_lr * jnp.minimum(step / warmup_steps, jnp.sqrt(warmup_steps / step))
  return schedule


def make_optimizer(train: ml_collections.ConfigDict) -> optax.GradientTransformation:
  return optax.chain(
      optax.clip_by_global_norm(train.grad_clip_norm),
      optax.adamw(learning_rate_schedule(train.peak_lr, train.warmup_steps), b1=0.9, b2=0.98,
                  eps=1e-9, weight_decay=train.weight_decay))


def cross_entropy(logits_BTV, targets_BT, label_smoothing: float):
  """(sum of per-token losses, sum of correct argmaxes, number of target tokens), pad excluded.

  The loss is the smoothed cross-entropy minus its minimum (the smoothed labels' entropy), so a
  perfect model scores 0 as in flax's wmt example.
  """
  weights_BT = (targets_BT != PAD).astype(jnp.float32)
  labels_BTV = optax.smooth_labels(jax.nn.one_hot(targets_BT, logits_BTV.shape[-1]),
                                   label_smoothing)
  entropy_BT = -jnp.sum(jax.scipy.special.xlogy(labels_BTV, labels_BTV), axis=-1)
  loss_BT = optax.softmax_cross_entropy(logits_BTV, labels_BTV) - entropy_BT
  correct_BT = jnp.argmax(logits_BTV, axis=-1) == targets_BT
  return jnp.sum(loss_BT * weights_BT), jnp.sum(correct_BT * weights_BT), jnp.sum(weights_BT)


def train_step(state: TrainState, batch, *, model, tx, label_smoothing: float):
  dropout_rng = jax.random.fold_in(state.rng, state.step)

  def loss_fn(params):
    logits = model.apply({"params": params}, batch["src"], batch["tgt_in"], train=True,
                         rngs={"dropout": dropout_rng})
    loss, correct, count = cross_entropy(logits, batch["tgt_out"], label_smoothing)
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


def init_state(config, task: Task, model, tx) -> TrainState:
  param_rng, dropout_rng, train_rng = jax.random.split(jax.random.PRNGKey(config.seed), 3)
  example = data.train_batch(task, config.seed, 0, 2, 1, config.train.length_buckets)
  params = jax.jit(model.init)({"params": param_rng, "dropout": dropout_rng}, example["src"],
                               example["tgt_in"])["params"]
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
    model = Transformer(model.config.replace(attention_implementation=ring_implementation))
  state = sharding.shard_train_state(state, mesh)
  state_shardings = sharding.shardings_for(state, mesh)
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
      batch = data.train_batch(task, config.seed, step - 1, config.train.batch_size,
                               config.train.bucket_window, config.train.length_buckets)
      window_tokens += int(np.sum(batch["src"] != PAD) + np.sum(batch["tgt_out"] != PAD))
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
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  task = get_task(config.task.name, **config.task.kwargs)
  cfg = model_config(config, task)
  model = Transformer(cfg)
  tx = make_optimizer(config.train)
  state = init_state(config, task, model, tx)
  evaluator = Evaluator(config, task, model, cfg)
  state, step_fn = shard_and_compile(config, state, model, tx)
  options = ocp.CheckpointManagerOptions(max_to_keep=2)
  with ocp.CheckpointManager(os.path.join(workdir, "checkpoints"), options=options) as manager:
    train_seconds = 0.0
    if manager.latest_step() is not None:
      restored = manager.restore(manager.latest_step(), args=_checkpoint_args(state))
      state, train_seconds = restored.state, restored.meta["train_seconds"]
    writer = metrics.MetricWriter(workdir, resume_step=int(state.step))
    try:
      state, train_seconds, eval_metrics = train_loop(
          config, task, state, train_seconds, step_fn, evaluator, manager, writer)
    finally:
      writer.close()
  if not eval_metrics:  # restarted after the last step: report the restored state
    eval_metrics = evaluator(state.params)

  plots.learning_curves(metrics.read_rows(workdir), os.path.join(workdir, "learning_curves.png"))
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
