"""Training throughput: the Transformer on flax_mha's attention vs on flax.linen's.

  python -m experiments.bench.training --config configs/dates.py
  python -m experiments.bench.training --config configs/dates.py:tiny --windows 3

Both models are the same `flax_mha.models.transformer.Transformer`, once with the default
`flax_mha.MultiHeadAttention` and once with `flax.linen.MultiHeadDotProductAttention` swapped in
(`TransformerConfig.attention_cls`). They train on the same batches with the same jitted step,
in one process; timed windows alternate between the two so load on the machine hits both alike.
Prints a markdown table of tokens/s (the runner's count: non-pad source + target tokens), the
median over the windows.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
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


def benchmark(config, windows: int, steps_per_window: int) -> list[dict]:
  """Median tokens/s of each attention over `windows` timed windows, after a warm-up window."""
  runner = Seq2SeqRunner(config)
  batches = [runner.train_batch(step) for step in range(steps_per_window)]
  tokens = sum(runner.num_tokens(b) for b in batches)
  tx = train.make_optimizer(config.train)
  base = runner.model.config
  runs = {}
  for name, cfg in (("flax_mha.MultiHeadAttention", base),
                    ("flax.linen.MultiHeadDotProductAttention",
                     base.replace(attention_cls=LinenAttention))):
    variant = Seq2SeqRunner(config, model=Transformer(cfg))
    state = train.init_state(variant, tx)
    step_fn = jax.jit(functools.partial(train.train_step, runner=variant, model=variant.model,
                                        tx=tx, label_smoothing=config.train.label_smoothing))
    runs[name] = {"step_fn": step_fn, "state": state,
                  "params": sum(x.size for x in jax.tree.leaves(state.params))}

  def window(run):
    """One pass through `batches`, always from the initial state (the step donates nothing)."""
    state = run["state"]
    for batch in batches:
      state, metrics = run["step_fn"](state, batch)
    jax.block_until_ready((state, metrics))

  passes = {name: functools.partial(window, run) for name, run in runs.items()}
  seconds = timing.round_robin(passes, windows, warmups=1)  # the warm-up compiles every shape
  rates = {name: tokens / np.array(seconds[name]) for name in runs}
  return [{"attention": name, "params": run["params"],
           "tokens_per_second": float(np.median(rates[name])),
           "min": float(np.min(rates[name])), "max": float(np.max(rates[name]))}
          for name, run in runs.items()]


def markdown(rows: list[dict], config) -> str:
  baseline = rows[-1]["tokens_per_second"]
  lines = [f"task `{config.task.name}`, batch {config.train.batch_size}, "
           f"d={config.model.d_model}, {config.model.num_encoder_layers}+"
           f"{config.model.num_decoder_layers} layers, backend {jax.default_backend()}", "",
           "| attention | params | tokens/s (median) | min | max | vs linen |",
           "|---|---|---|---|---|---|"]
  lines += [f"| {r['attention']} | {r['params']:,} | {r['tokens_per_second']:,.0f} | "
            f"{r['min']:,.0f} | {r['max']:,.0f} | {r['tokens_per_second'] / baseline:.2f}x |"
            for r in rows]
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config, args = flags.FLAGS.config, flags.FLAGS
  windows, steps = (1, 1) if args.smoke else (args.windows, args.steps_per_window)
  print(markdown(benchmark(config, windows, steps), config))


if __name__ == "__main__":
  config_flags.DEFINE_config_file(
      "config", "configs/dates.py", "experiment config: configs/<name>.py[:arg]",
      lock_config=True)
  flags.DEFINE_integer("windows", 5, "timed windows per attention")
  flags.DEFINE_integer("steps_per_window", 16, "training steps per window")
  flags.DEFINE_bool("smoke", False, "1 window of 1 step: that the command runs, no figures "
                    "(with a config's tiny variant, the least it can compile)")
  app.run(main)
