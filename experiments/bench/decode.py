"""Decode-time attention and a decoding model's step, on the CPU, float32.

  python -m experiments.bench.decode                 # every part -> docs/decode_cpu.md
  python -m experiments.bench.decode --part attention --part model
  python -m experiments.bench.decode --smoke         # seconds: tiny shapes, nothing written

Parts:
  attention  T=1 query over S=32768 keys, B=1, H=8, G=2, K=128: flax_mha (None, which runs the
             decode kernel; and "xla"), jax.nn.dot_product_attention and torch SDPA, each in
             a process of its own (the processes taking turns, see experiments.bench.timing);
             medians over all turns. None's output is checked against jax.nn's.
  sweep      the decode kernel's key block and partition count (BLOCK_K, SPLITS) on that shape,
             timed round-robin in one process (one kernel's settings, not peers).
  model      the per-token latency of a 4-layer model (D=256, H=8 heads, MLP 4D) at position
             512 of a 4096-token cache: flax_mha.nnx.MultiHeadAttention with its cache as data
             against the same model on flax.nnx.MultiHeadAttention with its decode cache (same
             weights: flax's module has no GQA, so both use H key/value heads; outputs checked
             equal), each model in a process of its own, the processes taking turns; medians.
  rolling    a local layer's cache bytes against the generated length (1k, 8k, 64k tokens),
             beside a global layer's (no timing).
"""

from __future__ import annotations

import argparse
import functools
import json
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
MODULE = "experiments.bench.decode"  # its workers: python -m MODULE --time-case <system>


def _qkv(b, t, s, h, g, k, v):
  rng = np.random.default_rng(0)
  return (jnp.asarray(rng.standard_normal((b, t, h, k)), jnp.float32),
          jnp.asarray(rng.standard_normal((b, s, g, k)), jnp.float32),
          jnp.asarray(rng.standard_normal((b, s, g, v)), jnp.float32))


ATTENTION = {"flax_mha (None: decode)": flax_mha.dot_product_attention,
             "flax_mha xla": functools.partial(flax_mha.dot_product_attention,
                                               implementation="xla"),
             "jax.nn": jax.nn.dot_product_attention}
TORCH_SDPA = "torch SDPA"


def _torch_sdpa(b, t, s, h, g, k, v):
  """fn() of torch SDPA's forward on [B, H, T, K] x [B, G, S, K] (float32); torch is imported
  by its worker alone."""
  import torch  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  q_BHTK, k_BGSK, v_BGSV = torch.randn(b, h, t, k), torch.randn(b, g, s, k), torch.randn(b, g, s, v)
  return lambda: torch.nn.functional.scaled_dot_product_attention(q_BHTK, k_BGSK, v_BGSV,
                                                                  enable_gqa=True)


def _time_attention(name: str, shape, rounds: int) -> dict:
  """Worker: {"seconds": [...], "check": its output, flat (None for torch)} of one system."""
  if name == TORCH_SDPA:
    return dict(seconds=timing.round_robin({name: _torch_sdpa(**shape)}, rounds)[name], check=None)
  fn = timing.blocking(ATTENTION[name], *_qkv(**shape))
  return dict(seconds=timing.round_robin({name: fn}, rounds)[name],
              check=np.asarray(fn()).ravel().tolist())


def attention(rounds: int, alternations: int, worker_args: list[str]) -> list[str]:
  """Markdown: each system timed in its own process, `alternations` turns of `rounds`."""
  reports = timing.isolated(MODULE, [*ATTENTION, TORCH_SDPA], turns=alternations,
                            extra_args=worker_args)
  np.testing.assert_allclose(reports["flax_mha (None: decode)"][0]["check"],
                             reports["jax.nn"][0]["check"], atol=1e-4, rtol=1e-4)
  ms = {name: 1e3 * statistics.median(t) for name, t in timing.pooled_seconds(reports).items()}
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


def _our_layers(blocks, caches, x):
  new = []
  for block, cache in zip(blocks, caches):
    y, cache = block.attention(block.norm1(x), cache=cache)
    x = block.mlp(x + y)
    new.append(cache)
  return x, new


def _their_layers(blocks, x):
  for block in blocks:
    x = block.mlp(x + block.attention(block.norm1(x), decode=True))
  return x


def _our_loop(blocks, x_BTD, capacity: int, steps: int):
  """fn() -> the last of `steps` tokens that ours decodes in one compiled loop (its caches
  carried, updated in place) after the prompt x_BTD, each output fed back as the next input."""
  empty = [block.attention.new_cache(1, capacity) for block in blocks]
  caches = nnx.jit(_our_layers)(blocks, empty, x_BTD)[1]
  graph, state = nnx.split(blocks)

  @jax.jit
  @cache_lib.caller_makes_room  # the loop stays within the capacity, as decoding's loops do
  def loop(state, caches, token):
    blocks = nnx.merge(graph, state)
    return jax.lax.fori_loop(0, steps, lambda _, c: _our_layers(blocks, c[1], c[0]),
                             (token, caches))[0]

  token = x_BTD[:, -1:]
  return lambda: jax.block_until_ready(loop(state, caches, token))


def _their_loop(blocks, x_BTD, capacity: int, steps: int):
  """_our_loop for flax's model, its decode cache filled a token at a time (as it decodes)."""
  for block in blocks:
    block.attention.init_cache((1, capacity, x_BTD.shape[-1]))
  fill = nnx.jit(_their_layers)
  for t in range(x_BTD.shape[1]):
    fill(blocks, x_BTD[:, t:t + 1])
  graph, state = nnx.split(blocks)

  @jax.jit
  def loop(state, token):
    def body(_, carry):
      token, state = carry
      blocks = nnx.merge(graph, state)
      return _their_layers(blocks, token), nnx.state(blocks)
    return jax.lax.fori_loop(0, steps, body, (token, state))[0]

  token = x_BTD[:, -1:]
  return lambda: jax.block_until_ready(loop(state, token))


OURS, THEIRS = "flax_mha.nnx (cache as data)", "flax.nnx.MultiHeadAttention (decode=True)"


def _time_model(name: str, rounds: int, *, d=256, h=8, layers=4, capacity=4096, position=512,
                steps=32) -> dict:
  """Worker: {"seconds": [seconds per token...], "check": the last token, flat} of one model
  (see the docstring): each timed call decodes `steps` tokens from `position`."""
  ours, theirs = _models(d, h, layers)
  x_BTD = jax.random.normal(jax.random.key(0), (1, position, d))
  run = (_our_loop(ours, x_BTD, capacity, steps) if name == OURS
         else _their_loop(theirs, x_BTD, capacity, steps))
  seconds = timing.round_robin({name: run}, rounds)[name]
  return dict(seconds=[t / steps for t in seconds], check=np.asarray(run()).ravel().tolist())


def model(rounds: int, alternations: int, worker_args: list[str]) -> list[str]:
  """Markdown: per-token latency of each model timed in its own process, `alternations` turns
  of `rounds`; both models' outputs checked equal."""
  reports = timing.isolated(MODULE, [OURS, THEIRS], turns=alternations, extra_args=worker_args)
  np.testing.assert_allclose(reports[OURS][0]["check"], reports[THEIRS][0]["check"],
                             atol=1e-3, rtol=1e-3)
  ms = {name: 1e3 * statistics.median(t) for name, t in timing.pooled_seconds(reports).items()}
  rows = [f"| {name} | {t:.3f} | {t / ms[OURS]:.2f}x |" for name, t in ms.items()]
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
  parser.add_argument("--time-case", default=None, help=argparse.SUPPRESS)  # a worker's system
  args = parser.parse_args()
  parts = args.part or ["attention", "sweep", "model", "rolling"]
  shape = dict(SHAPE, s=1024) if args.smoke else SHAPE
  rounds, alternations = (2, 1) if args.smoke else (7, 3)
  sizes = dict(d=32, h=4, layers=2, capacity=256, position=32, steps=4) if args.smoke else {}
  if args.time_case:
    print(json.dumps(_time_model(args.time_case, rounds, **sizes)
                     if args.time_case in (OURS, THEIRS)
                     else _time_attention(args.time_case, shape, rounds)))
    return
  worker_args = ["--smoke"] if args.smoke else []
  sections = {"attention": lambda: attention(rounds, alternations, worker_args),
              "sweep": lambda: sweep(shape, rounds),
              "model": lambda: model(rounds, alternations, worker_args),
              "rolling": lambda: rolling((64, 512) if args.smoke else (1024, 8192, 65536))}
  timing.write_report("Decode-time attention (CPU, float32)", "python -m experiments.bench.decode", parts, sections,
                      args.out, args.smoke)


if __name__ == "__main__":
  main()
