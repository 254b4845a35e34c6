"""Training-step time of a small NNX model on three attention modules, in one process.

  python -m experiments.bench.nnx            # 5 timed windows of 20 steps per variant
  python -m experiments.bench.nnx --quick    # seconds: 3 windows of 3 steps

The model: token embedding -> 2 x (pre-LN causal self-attention + pre-LN MLP, residual) ->
logits; D=128, H=4 heads, T=64, batch 32, vocabulary 256, adam; one jitted step (split/merge
around `jax.jit`, state donated). The variants differ in the attention module only:
  nnx    flax_mha.nn.nnx.SelfAttention
  bridge flax_mha.SelfAttention (linen) through nnx.bridge.ToNNX
  flax   flax.nnx.MultiHeadAttention
All start from the same parameters (their trees are equal), so their first losses must agree:
the script checks that. After a compiling window each and one untimed window more, timed windows
run the variants in turn (the order rotating) so load on a shared machine hits all alike; it
prints the median ms/step and the median of each window's ratios.
"""

from __future__ import annotations

import argparse
import functools
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


def build(name: str, params=None):
  """(jitted step, state) for one variant; `params` (an nnx.Param state) replaces its init."""
  model = Model(VARIANTS[name], nnx.Rngs(0))
  if name == "bridge":
    nnx.bridge.lazy_init(model, jnp.zeros((BATCH, T), jnp.int32))
  if params is not None:
    nnx.update(model, jax.tree.map(jnp.copy, params))  # copies: every step donates its state
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

  return jax.jit(step, donate_argnums=0), state, nnx.state(model, nnx.Param)


def benchmark(windows: int, steps: int) -> dict[str, list[float]]:
  """ms/step of every variant in each timed window (a window: one pass through `steps` batches)."""
  batches = [jax.random.randint(jax.random.key(i), (BATCH, T + 1), 0, VOCAB)
             for i in range(steps)]
  runs, params = {}, None
  for name in VARIANTS:
    step, state, model_params = build(name, params)
    params = model_params if params is None else params  # every variant starts from "nnx"'s
    runs[name] = {"step": step, "state": state}
  first = {}
  for name, run in runs.items():  # warm-up: compile, and the first loss of each variant
    for i, batch in enumerate(batches):
      run["state"], loss = run["step"](run["state"], batch)
      if i == 0:
        first[name] = float(loss)
  spread = max(first.values()) - min(first.values())
  print("first losses " + ", ".join(f"{n} {v:.6f}" for n, v in first.items()))
  if spread > 1e-4:
    raise RuntimeError(f"variants differ on the same parameters: {first}")

  def window(run):
    """One pass through `batches`, to its last loss."""
    for batch in batches:
      run["state"], loss = run["step"](run["state"], batch)
    jax.block_until_ready(loss)

  passes = {name: functools.partial(window, run) for name, run in runs.items()}
  seconds = timing.round_robin(passes, windows, warmups=1, rotate=True)
  return {name: [1e3 * t / len(batches) for t in times] for name, times in seconds.items()}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  size = parser.add_mutually_exclusive_group()
  size.add_argument("--quick", action="store_true", help="3 windows of 3 steps")
  size.add_argument("--smoke", action="store_true",
                    help="1 window of 1 step: that the command runs, no figures")
  parser.add_argument("--windows", type=int, default=5)
  parser.add_argument("--steps", type=int, default=20, help="training steps per window")
  args = parser.parse_args()
  windows, steps = (1, 1) if args.smoke else (3, 3) if args.quick else (args.windows, args.steps)
  print(f"{jax.devices()[0].device_kind}: D={D} H={H} T={T} batch={BATCH} layers={LAYERS}, "
        f"{windows} windows x {steps} steps")
  ms = benchmark(windows, steps)
  median = {name: statistics.median(v) for name, v in ms.items()}
  # Ratios within each round, then their median: load that shifts between rounds cancels.
  ratio = lambda name, base: statistics.median(a / b for a, b in zip(ms[name], ms[base]))
  print("| attention | ms/step (median) | windows | vs flax | vs nnx |")
  print("|---|---|---|---|---|")
  for name, m in median.items():
    cells = " ".join(f"{v:.1f}" for v in ms[name])
    print(f"| {name} | {m:.2f} | {cells} | {ratio(name, 'flax'):.3f} | "
          f"{ratio(name, 'nnx'):.3f} |")
  print("ratios: the median over windows of (ms/step) / (the same window's ms/step of flax, nnx)")


if __name__ == "__main__":
  main()
