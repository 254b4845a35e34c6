"""Decode-time attention and a decoding model's step, on the CPU, float32.

  python -m experiments.bench.decode                 # every part -> docs/decode_cpu.md
  python -m experiments.bench.decode --part attention --part model
  python -m experiments.bench.decode --smoke         # seconds: tiny shapes, nothing written

Parts:
  attention  T=1 query over S=32768 keys, B=1, H=8, G=2, K=128: flax_mha (None, which runs the
             decode kernel; and "xla") and jax.nn.dot_product_attention timed round-robin in
             this process, torch SDPA timed alone in its own process; medians.
  sweep      the decode kernel's key block and partition count (BLOCK_K, SPLITS) on that shape.
  model      the per-token latency of a 4-layer model (D=256, H=8 heads, MLP 4D) at position
             512 of a 4096-token cache: flax_mha.nnx.MultiHeadAttention with its cache as data
             against the same model on flax.nnx.MultiHeadAttention with its decode cache (same
             weights: flax's module has no GQA, so both use H key/value heads; outputs checked
             equal), timed round-robin.
  rolling    a local layer's cache bytes against the generated length (1k, 8k, 64k tokens),
             beside a global layer's.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import flax_mha
from experiments.bench import timing
from flax_mha import cache as cache_lib
from flax_mha.kernels import decode
from flax_mha.models.lm import DecoderLM, LMConfig

SHAPE = dict(b=1, t=1, s=32768, h=8, g=2, k=128, v=128)


def _qkv(b, t, s, h, g, k, v):
  rng = np.random.default_rng(0)
  return (jnp.asarray(rng.standard_normal((b, t, h, k)), jnp.float32),
          jnp.asarray(rng.standard_normal((b, s, g, k)), jnp.float32),
          jnp.asarray(rng.standard_normal((b, s, g, v)), jnp.float32))


def attention(shape, rounds: int, alternations: int) -> list[str]:
  q, k, v = _qkv(**shape)
  fns = {"flax_mha (None: decode)": timing.blocking(flax_mha.dot_product_attention, q, k, v),
         "flax_mha xla": timing.blocking(
             lambda q, k, v: flax_mha.dot_product_attention(q, k, v, implementation="xla"),
             q, k, v),
         "jax.nn": timing.blocking(jax.nn.dot_product_attention, q, k, v)}
  out = np.asarray(fns["flax_mha (None: decode)"]())
  np.testing.assert_allclose(out, np.asarray(fns["jax.nn"]()), atol=1e-4, rtol=1e-4)
  times = {name: [] for name in (*fns, "torch SDPA (alone)")}
  for _ in range(alternations):  # JAX's round and torch's process in turn: load hits both
    for name, seconds in timing.round_robin(fns, rounds).items():
      times[name] += seconds
    times["torch SDPA (alone)"] += timing.torch_sdpa_seconds(**shape, rounds=rounds)
  ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
  ours = ms["flax_mha (None: decode)"]
  rows = [f"| {name} | {value:.2f} | {value / ours:.2f}x |" for name, value in ms.items()]
  return ["| system | ms (median) | its time / flax_mha's |", "|---|---|---|", *rows]


def sweep(shape, rounds: int) -> list[str]:
  q, k, v = _qkv(**shape)
  fns = {(block, splits): timing.blocking(
      lambda q, k, v, impl=decode.make_attention(block, splits):
      flax_mha.dot_product_attention(q, k, v, implementation=impl), q, k, v)
      for block in (256, 512, 1024, 2048) for splits in (1, 2, 4)}
  ms = {key: 1e3 * t for key, t in timing.median_seconds(fns, rounds).items()}
  rows = [f"| {block} | {splits} | {t:.2f} |" for (block, splits), t in ms.items()]
  return ["| keys per block | partitions | ms (median) |", "|---|---|---|", *rows]


class _Block(nnx.Module):
  """Pre-LN block: causal self-attention with a KV cache, then a 4·D GELU MLP."""

  def __init__(self, attention_module, d: int, rngs: nnx.Rngs):
    self.norm1, self.norm2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
    self.attention = attention_module
    self.mlp_in, self.mlp_out = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

  def mlp(self, x):
    return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.norm2(x))))


def _models(d, h, layers):
  """Two models with the same weights: ours (flax_mha, cache as data) and flax's (decode)."""
  ours = [_Block(flax_mha.nnx.SelfAttention(h, d, rngs=nnx.Rngs(i)), d, nnx.Rngs(100 + i))
          for i in range(layers)]
  theirs = []
  for i, block in enumerate(ours):
    flax_attention = nnx.MultiHeadAttention(h, d, decode=True, rngs=nnx.Rngs(0))
    nnx.update(flax_attention, nnx.state(block.attention, nnx.Param))
    other = _Block(flax_attention, d, nnx.Rngs(100 + i))
    theirs.append(other)
  return ours, theirs


def model(rounds: int, *, d=256, h=8, layers=4, capacity=4096, position=512,
          steps=32) -> list[str]:
  """Per-token latency from `position` of a `capacity`-token cache (see the docstring): each
  model decodes `steps` tokens in one compiled loop (its cache carried, updated in place),
  feeding its output back as the next input; ms per token = the loop's time / steps."""
  ours, theirs = _models(d, h, layers)
  for block in theirs:
    block.attention.init_cache((1, capacity, d))
  x = jax.random.normal(jax.random.key(0), (1, position, d))

  def our_layers(blocks, caches, x):
    new = []
    for block, cache in zip(blocks, caches):
      y, cache = block.attention(block.norm1(x), cache=cache)
      x = block.mlp(x + y)
      new.append(cache)
    return x, new

  def their_layers(blocks, x):
    for block in blocks:
      x = block.mlp(x + block.attention(block.norm1(x), decode=True))
    return x

  caches = nnx.jit(our_layers)(ours, [b.attention.new_cache(1, capacity) for b in ours], x)[1]
  fill = nnx.jit(their_layers)
  for t in range(position):  # flax's cache is filled a token at a time, as it decodes
    fill(theirs, x[:, t:t + 1])
  our_graph, our_state = nnx.split(ours)
  their_graph, their_state = nnx.split(theirs)

  @jax.jit
  @cache_lib.caller_makes_room  # the loop stays within the capacity, as decoding's loops do
  def our_loop(state, caches, token):
    blocks = nnx.merge(our_graph, state)
    return jax.lax.fori_loop(0, steps, lambda _, c: our_layers(blocks, c[1], c[0]),
                             (token, caches))[0]

  @jax.jit
  def their_loop(state, token):
    def body(_, carry):
      token, state = carry
      blocks = nnx.merge(their_graph, state)
      return their_layers(blocks, token), nnx.state(blocks)
    return jax.lax.fori_loop(0, steps, body, (token, state))[0]

  token = x[:, -1:]
  np.testing.assert_allclose(our_loop(our_state, caches, token), their_loop(their_state, token),
                             atol=1e-3, rtol=1e-3)
  fns = {"flax_mha.nnx (cache as data)":
         lambda: jax.block_until_ready(our_loop(our_state, caches, token)),
         "flax.nnx.MultiHeadAttention (decode=True)":
         lambda: jax.block_until_ready(their_loop(their_state, token))}
  ms = {name: 1e3 * t / steps for name, t in timing.median_seconds(fns, rounds).items()}
  ours_ms = ms["flax_mha.nnx (cache as data)"]
  rows = [f"| {name} | {t:.3f} | {t / ours_ms:.2f}x |" for name, t in ms.items()]
  return ["| model | ms per token (median) | its time / ours |", "|---|---|---|", *rows]


def rolling(lengths=(1024, 8192, 65536)) -> list[str]:
  cfg = LMConfig(vocab_size=64, d_model=128, num_heads=4, num_kv_heads=2, num_layers=2,
                 local_window=16, sink_tokens=4)
  rows = []
  for n in lengths:
    caches = DecoderLM(cfg).init_cache(jnp.zeros((1, 1), jnp.int32), n)
    local, global_ = (sum(x.nbytes for x in jax.tree.leaves(c)) for c in caches)
    rows.append(f"| {n} | {local} | {global_} |")
  return ["| tokens | local layer (window 16 + 4 sink tokens) bytes | global layer bytes |",
          "|---|---|---|", *rows]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", action="append",
                      choices=("attention", "sweep", "model", "rolling"))
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, nothing written")
  parser.add_argument("--out", default="docs/decode_cpu.md")
  args = parser.parse_args()
  parts = args.part or ["attention", "sweep", "model", "rolling"]
  shape = dict(SHAPE, s=1024) if args.smoke else SHAPE
  rounds, alternations = (2, 1) if args.smoke else (7, 3)
  sizes = dict(d=32, h=4, layers=2, capacity=256, position=32, steps=4) if args.smoke else {}
  sections = {"attention": lambda: attention(shape, rounds, alternations),
              "sweep": lambda: sweep(shape, rounds),
              "model": lambda: model(rounds, **sizes),
              "rolling": lambda: rolling((64, 512) if args.smoke else (1024, 8192, 65536))}
  timing.write_report("Decode-time attention (CPU, float32)", "python -m experiments.bench.decode", parts, sections,
                      args.out, args.smoke)


if __name__ == "__main__":
  main()
