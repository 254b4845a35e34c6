"""Training-step time of a small NNX model on three attention modules, each in its own process.

  python -m experiments.bench.nnx            # 3 turns of 5 timed windows of 20 steps per variant
  python -m experiments.bench.nnx --quick    # 2 turns of 3 windows of 3 steps

The model: token embedding -> 2 x (pre-LN causal self-attention + pre-LN MLP, residual) ->
logits; D=128, H=4 heads, T=64, batch 32, vocabulary 256, adam; one jitted step (split/merge
around `jax.jit`, state donated). The variants differ in the attention module only:
  nnx    flax_mha.nn.nnx.SelfAttention
  bridge flax_mha.SelfAttention (linen) through nnx.bridge.ToNNX
  flax   flax.nnx.MultiHeadAttention
All start from the same parameters, "nnx"'s seeded init (their trees are equal), so their first
losses must agree: each worker prints its variant's, and the script checks them. Each variant
runs in a process of its own, the processes taking turns (the order reversed every other turn,
see experiments.bench.timing) so load on a shared machine hits all alike; in its process, after
a compiling step and two untimed windows, a variant times --windows windows. The script
prints the median ms/step over all windows of all turns and the median of the ratios between
the variants' windows of the same index in the same turn.
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import flax_mha
from experiments.bench import timing
from flax_mha.nn import nnx as flax_mha_nnx

D, H, T, BATCH, VOCAB, LAYERS = 128, 4, 64, 32, 256, 2  # VOCAB: C in the dimension key

VARIANTS = {
    "nnx": lambda rngs: flax_mha_nnx.SelfAttention(H, D, rngs=rngs),
    "bridge": lambda rngs: nnx.bridge.ToNNX(flax_mha.SelfAttention(num_heads=H), rngs=rngs),
    "flax": lambda rngs: nnx.MultiHeadAttention(H, D, decode=False, rngs=rngs),
}


class Block(nnx.Module):
  """Pre-LN residual block: causal self-attention, then a 4·D GELU MLP."""

  def __init__(self, attention: nnx.Module, rngs: nnx.Rngs):
    self.attention_norm = nnx.LayerNorm(D, rngs=rngs)
    self.attention = attention
    self.mlp_norm = nnx.LayerNorm(D, rngs=rngs)
    self.mlp_in = nnx.Linear(D, 4 * D, rngs=rngs)
    self.mlp_out = nnx.Linear(4 * D, D, rngs=rngs)

  def __call__(self, x_BTD):
    x_BTD = x_BTD + self.attention(self.attention_norm(x_BTD), is_causal=True)
    return x_BTD + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x_BTD))))


class Model(nnx.Module):
  """tokens [B, T] -> logits [B, T, C]."""

  def __init__(self, make_attention, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.blocks = nnx.List([Block(make_attention(rngs), rngs) for _ in range(LAYERS)])
    self.norm = nnx.LayerNorm(D, rngs=rngs)
    self.logits = nnx.Linear(D, VOCAB, rngs=rngs)

  def __call__(self, tokens_BT):
    x_BTD = self.embed(tokens_BT)
    for block in self.blocks:
      x_BTD = block(x_BTD)
    return self.logits(self.norm(x_BTD))


def build(name: str):
  """(jitted step, state) for one variant, its parameters "nnx"'s seeded init (so that every
  variant, in whichever process, starts from the same ones)."""
  model = Model(VARIANTS[name], nnx.Rngs(0))
  if name == "bridge":
    nnx.bridge.lazy_init(model, jnp.zeros((BATCH, T), jnp.int32))
  if name != "nnx":
    nnx.update(model, nnx.state(Model(VARIANTS["nnx"], nnx.Rngs(0)), nnx.Param))
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  def step(state, tokens_BL):  # L = T + 1: inputs are tokens[:, :-1], targets tokens[:, 1:]
    model, optimizer = nnx.merge(graphdef, state)
    def loss_fn(model):
      logits = model(tokens_BL[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens_BL[:, 1:]).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  return jax.jit(step, donate_argnums=0), state


def time_case(name: str, windows: int, steps: int) -> dict:
  """Worker: {"seconds": [...], "first_loss": ...} of one variant: the seconds of each timed
  window (a window: one pass through `steps` batches), its loss on the first batch."""
  batches = [jax.random.randint(jax.random.key(i), (BATCH, T + 1), 0, VOCAB)
             for i in range(steps)]
  step, state = build(name)
  run = {"state": state}

  def window():
    """One pass through `batches`, to its last loss."""
    for batch in batches:
      run["state"], loss = step(run["state"], batch)
    return jax.block_until_ready(loss)

  run["state"], first_loss = step(run["state"], batches[0])  # compiles
  seconds = timing.round_robin({name: window}, windows, warmups=2)[name]
  return dict(seconds=seconds, first_loss=float(first_loss))


def benchmark(turns: int, windows: int, steps: int) -> dict[str, list[float]]:
  """ms/step of every variant in each timed window, each variant in its own process for
  `turns` turns; raises where the variants' first losses differ."""
  reports = timing.isolated("experiments.bench.nnx", list(VARIANTS), turns=turns,
                            extra_args=["--windows", str(windows), "--steps", str(steps)])
  first = {name: mine[0]["first_loss"] for name, mine in reports.items()}
  print("first losses " + ", ".join(f"{n} {v:.6f}" for n, v in first.items()))
  if max(first.values()) - min(first.values()) > 1e-4:
    raise RuntimeError(f"variants differ on the same parameters: {first}")
  return {name: [1e3 * t / steps for t in seconds]
          for name, seconds in timing.pooled_seconds(reports).items()}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  size = parser.add_mutually_exclusive_group()
  size.add_argument("--quick", action="store_true", help="2 turns of 3 windows of 3 steps")
  size.add_argument("--smoke", action="store_true",
                    help="1 turn of 1 window of 1 step: that the command runs, no figures")
  parser.add_argument("--turns", type=int, default=3, help="processes per variant, in turn")
  parser.add_argument("--windows", type=int, default=5, help="timed windows per process")
  parser.add_argument("--steps", type=int, default=20, help="training steps per window")
  parser.add_argument("--time-case", default=None, help=argparse.SUPPRESS)  # a worker's variant
  args = parser.parse_args()
  if args.time_case:
    print(json.dumps(time_case(args.time_case, args.windows, args.steps)))
    return
  turns, windows, steps = ((1, 1, 1) if args.smoke else (2, 3, 3) if args.quick
                           else (args.turns, args.windows, args.steps))
  print(f"{jax.devices()[0].device_kind}: D={D} H={H} T={T} batch={BATCH} layers={LAYERS}, "
        f"{turns} turns of {windows} windows x {steps} steps")
  ms = benchmark(turns, windows, steps)
  median = {name: statistics.median(v) for name, v in ms.items()}
  # Ratios of windows of one index in one turn, then their median: load that shifts between
  # turns cancels.
  ratio = lambda name, base: statistics.median(a / b for a, b in zip(ms[name], ms[base]))
  print("| attention | ms/step (median) | windows | vs flax | vs nnx |")
  print("|---|---|---|---|---|")
  for name, m in median.items():
    cells = " ".join(f"{v:.1f}" for v in ms[name])
    print(f"| {name} | {m:.2f} | {cells} | {ratio(name, 'flax'):.3f} | "
          f"{ratio(name, 'nnx'):.3f} |")
  print("ratios: the median over windows of (ms/step) / (ms/step of flax, nnx in the window of "
        "the same index and turn)")


if __name__ == "__main__":
  main()
