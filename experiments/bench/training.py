"""Training throughput: the Transformer on flax_mha's attention vs on flax.linen's.

  python -m experiments.bench.training --config configs/dates.py
  python -m experiments.bench.training --config configs/dates.py:tiny --turns 2 --windows 3

Both models are the same `flax_mha.models.transformer.Transformer`, once with the default
`flax_mha.MultiHeadAttention` and once with `flax.linen.MultiHeadDotProductAttention` swapped in
(`TransformerConfig.attention_cls`), and a third time with the attention core replaced by a
stand-in that costs next to nothing (`free_core`: projections kept, no logits): the step's
floor, what any attention core could gain at most. They train on the same batches with the
same jitted step,
each in a process of its own: the processes take turns, the order reversed every other turn
(see experiments.bench.timing), and each times --windows windows after a compiling one. Prints
a markdown table of tokens/s (the runner's count: non-pad source + target tokens): the median
over all windows of all turns, and the median of the ratios of windows of the same index in the
same turn.
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from experiments import train
from experiments.bench import timing
from experiments.seq2seq import Seq2SeqRunner
from flax_mha.models.transformer import Transformer


class LinenAttention(nn.Module):
  """`flax.linen.MultiHeadDotProductAttention` behind `flax_mha.MultiHeadAttention`'s signature."""
  num_heads: int
  num_kv_heads: int | None = None
  dropout_rate: float = 0.0
  dtype: Any = None
  implementation: str | None = None  # accepted for the signature; linen has one implementation
  decode: bool = False

  @nn.compact
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None, is_causal=False,
               deterministic=True, sow_weights=False):
    if self.num_kv_heads not in (None, self.num_heads):
      raise ValueError("flax.linen attention has no grouped key/value heads")
    if is_causal:
      mask = nn.combine_masks(mask, nn.make_causal_mask(inputs_q[..., 0]))
    return nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads, dropout_rate=self.dropout_rate, dtype=self.dtype,
        decode=self.decode, name="linen")(inputs_q, inputs_k, inputs_v, mask=mask,
                                          deterministic=deterministic, sow_weights=sow_weights)


def free_core(query, key, value, bias, mask, *, is_causal, scale, dropout_rate, dropout_rng,
              mods=None, return_residual=False):
  """A stand-in for the attention core that costs next to nothing: each query position gets
  the mean value (plus a term of the query and key means, so that every projection keeps its
  gradient). Not attention: the floor of a step whose core were free."""
  del bias, mask, is_causal, scale, dropout_rate, dropout_rng, mods, return_residual
  reps = query.shape[2] // key.shape[2]
  per_head = lambda x: jnp.repeat(x, reps, axis=1)  # [B, G, ...] -> [B, H, ...]
  values = per_head(value.mean(axis=1))[:, None]  # [B, 1, H, V]
  keys = per_head(key.mean(axis=(1, 3))[..., None])[:, None]  # [B, 1, H, 1]
  return values + query.mean(axis=-1, keepdims=True) * keys


# name -> (attention_cls or None for the default, attention_implementation or None)
VARIANTS = {"flax_mha.MultiHeadAttention": (None, None),
            "flax.linen.MultiHeadDotProductAttention": (LinenAttention, None),
            "flax_mha.MultiHeadAttention, core free (a floor)": (None, free_core)}


def time_case(config, name: str, windows: int, steps_per_window: int) -> dict:
  """Worker: {"seconds": [...], "tokens": ..., "params": ...} of one attention: the seconds of
  each timed window (a window: one pass through the same `steps_per_window` batches, always
  from the initial state; the step donates nothing), after an untimed one that compiles."""
  runner = Seq2SeqRunner(config)
  batches = [runner.train_batch(step) for step in range(steps_per_window)]
  tx = train.make_optimizer(config.train)
  attention_cls, implementation = VARIANTS[name]
  swaps = {field: x for field, x in (("attention_cls", attention_cls),
                                      ("attention_implementation", implementation))
           if x is not None}
  variant = runner if not swaps else Seq2SeqRunner(config, model=Transformer(
      runner.model.config.replace(**swaps)))
  initial = train.init_state(variant, tx)
  step_fn = jax.jit(functools.partial(train.train_step, runner=variant, model=variant.model,
                                      tx=tx, label_smoothing=config.train.label_smoothing))

  def window():
    state = initial
    for batch in batches:
      state, metrics = step_fn(state, batch)
    jax.block_until_ready((state, metrics))

  seconds = timing.round_robin({name: window}, windows, warmups=1)[name]
  return {"seconds": seconds, "tokens": sum(runner.num_tokens(b) for b in batches),
          "params": sum(x.size for x in jax.tree.leaves(initial.params))}


def benchmark(turns: int, worker_args: list[str]) -> list[dict]:
  """Tokens/s of each attention over all timed windows of `turns` turns of worker processes
  (each given `worker_args`, this command's own flags)."""
  reports = timing.isolated("experiments.bench.training", list(VARIANTS), turns=turns,
                            extra_args=worker_args)
  tokens = {name: mine[0]["tokens"] for name, mine in reports.items()}
  if len(set(tokens.values())) != 1:
    raise RuntimeError(f"the variants trained on different batches: {tokens}")
  rates = {name: [tokens[name] / t for t in seconds]
           for name, seconds in timing.pooled_seconds(reports).items()}
  linen = rates["flax.linen.MultiHeadDotProductAttention"]
  return [{"attention": name, "params": reports[name][0]["params"],
           "tokens_per_second": float(np.median(rate)), "min": float(np.min(rate)),
           "max": float(np.max(rate)), "windows": len(rate),
           "vs_linen": float(np.median([a / b for a, b in zip(rate, linen)]))}
          for name, rate in rates.items()]


def markdown(rows: list[dict], config) -> str:
  lines = [f"task `{config.task.name}`, batch {config.train.batch_size}, "
           f"d={config.model.d_model}, {config.model.num_encoder_layers}+"
           f"{config.model.num_decoder_layers} layers, backend {jax.default_backend()}", "",
           f"| attention | params | tokens/s (median of {rows[0]['windows']} windows) | min | "
           "max | vs linen |", "|---|---|---|---|---|---|"]
  lines += [f"| {r['attention']} | {r['params']:,} | {r['tokens_per_second']:,.0f} | "
            f"{r['min']:,.0f} | {r['max']:,.0f} | {r['vs_linen']:.2f}x |" for r in rows]
  lines += ["", "vs linen: the median over windows of tokens/s over linen's in the window of the "
            "same index and turn"]
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config, args = flags.FLAGS.config, flags.FLAGS
  windows, steps = (1, 1) if args.smoke else (args.windows, args.steps_per_window)
  if args["time-case"].value:
    print(json.dumps(time_case(config, args["time-case"].value, windows, steps)))
    return
  turns = 1 if args.smoke else args.turns
  print(markdown(benchmark(turns, sys.argv[1:]), config))


if __name__ == "__main__":
  config_flags.DEFINE_config_file(
      "config", "configs/dates.py", "experiment config: configs/<name>.py[:arg]",
      lock_config=True)
  flags.DEFINE_integer("turns", 3, "processes per attention, in turn")
  flags.DEFINE_integer("windows", 5, "timed windows per process")
  flags.DEFINE_integer("steps_per_window", 16, "training steps per window")
  flags.DEFINE_bool("smoke", False, "1 turn of 1 window of 1 step: that the command runs, no "
                    "figures (with a config's tiny variant, the least it can compile)")
  flags.DEFINE_string("time-case", None, "a worker's attention (set by the benchmark itself)")
  app.run(main)
