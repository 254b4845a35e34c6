"""The int8 KV cache against the float32 one: attention's error, a model's logits and tokens, bytes.

  python -m experiments.bench.int8_cache                        # random data, a random LM
  python -m experiments.bench.int8_cache --smoke                # seconds: tiny shapes
  python -m experiments.bench.int8_cache --workdir runs/lm_tiny  # + a run of experiments.train
  python -m experiments.bench.int8_cache --hf DIR [DIR ...]     # + Hugging Face checkpoints

Three parts, printed (nothing is written):
- attention: one step (T=1, B=4, H=8, G=2) over a full cache of S slots holding random keys
  and values (standard normal), the query too; the max |out(int8 cache) - out(float32 cache)|,
  and the median over rows of each row's max, for head dims K = 64, 128.
- bytes: a page pool's bytes per token and key/value head (keys and values), int8 values plus
  their float32 scales against float32 and bfloat16, for K = 64, 128, 256.
- models: 64 new greedy tokens after 4 prompts, float32 weights: the tokens `decoding.generate`
  gives with a float32 cache and with an int8 one (`cache_dtype=jnp.int8`), how many are the
  same (per row, and until the first change), and the max |logits| difference along the float
  cache's tokens (both caches fed the same tokens, so that the difference is the cache's
  alone). Models: a randomly initialised `DecoderLM` (local and global layers, untied output);
  the newest checkpoint of `--workdir` (its held-out prompts); each `--hf` checkpoint
  (`flax_mha.models.hf.load`; random prompts of its vocabulary).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from flax_mha import cache as cache_lib
from flax_mha.models import decoding
from flax_mha.models.lm import DecoderLM, LMConfig

NEW_TOKENS = 64


def attention_errors(k_dim: int, slots: int, seed: int = 0) -> tuple[float, float]:
  """(max, median over rows of the row's max) |int8 - float32| of one step's output."""
  b, h, g = 4, 8, 2
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (b, 1, h, k_dim))
  k, v = (jax.random.normal(key, (b, slots, g, k_dim)) for key in keys[1:3])
  step_k, step_v = (jax.random.normal(key, (b, 1, g, k_dim)) for key in jax.random.split(keys[3]))

  @jax.jit  # the data as arguments: XLA would fold constants for seconds
  def step(cache, q, k, v, step_k, step_v):
    cache = cache_lib.update(cache, k, v, jnp.broadcast_to(jnp.arange(slots), (b, slots)))
    return cache_lib.attend(q, step_k, step_v, cache)[0]

  make = lambda dtype: cache_lib.KVCache.create(b, slots + 1, g, k_dim, dtype=dtype)
  run = lambda dtype: step(make(dtype), q, k, v, step_k, step_v)
  err = jnp.abs(run(jnp.int8) - run(jnp.float32))
  return float(jnp.max(err)), float(jnp.median(jnp.max(err, axis=(1, 2, 3))))


def pool_bytes(k_dim: int) -> dict[str, float]:
  """Bytes per token and key/value head of a page pool (keys and values), by dtype."""
  per = {}
  for name, dtype in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16), ("int8", jnp.int8)):
    pool = cache_lib.PagedKVCache.create(4, 16, jnp.zeros((1, 4), jnp.int32), 1, k_dim,
                                         dtype=dtype)
    leaves = (pool.k_pages, pool.v_pages, pool.k_scales, pool.v_scales)
    per[name] = sum(x.nbytes for x in leaves if x is not None) / (4 * 16)
  return per


def compare_model(model, params, prompts, lengths, new_tokens: int) -> dict:
  """The float32 and int8 caches' greedy tokens and logits (see the module docstring)."""
  run = lambda dtype: decoding.generate(model, params, (prompts,), prompts, lengths,
                                        max_new_tokens=new_tokens, cache_dtype=dtype)
  want, got = np.asarray(run(jnp.float32)), np.asarray(run(jnp.int8))
  same = want == got
  first = [int(np.argmin(row)) if not row.all() else new_tokens for row in same]
  logits = {dtype: _forced_logits(model, params, prompts, lengths, jnp.asarray(want), dtype)
            for dtype in (jnp.float32, jnp.int8)}
  return dict(same=same.sum(axis=1).tolist(), until_first_change=first,
              logits_max_err=float(jnp.max(jnp.abs(logits[jnp.int8] - logits[jnp.float32]))),
              logits_scale=float(jnp.max(jnp.abs(logits[jnp.float32]))))


def _forced_logits(model, params, prompts, lengths, tokens_BN, dtype):
  """Logits [B, N, C] of the N tokens after each prompt, fed `tokens_BN` (the prompt's next
  token's logits first), over caches of `dtype`."""
  @jax.jit
  @cache_lib.caller_makes_room
  def run(params, prompts, lengths, tokens_BN):
    length = prompts.shape[1]
    cache = model.apply(params, prompts, length + tokens_BN.shape[1], dtype,
                        method="init_cache")
    positions = jnp.where(jnp.arange(length) < lengths[:, None], jnp.arange(length), -1)
    logits, cache = model.apply(params, prompts, cache, positions, method="logits")
    first = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]

    def body(cache, token_B):
      logits, cache = model.apply(params, token_B[:, None], cache, method="logits")
      return cache, logits[:, 0]
    rest = jax.lax.scan(body, cache, tokens_BN[:, :-1].T)[1]
    return jnp.concatenate([first[:, None], rest.swapaxes(0, 1)], axis=1)

  return run(params, prompts, lengths, tokens_BN)


def random_lm(smoke: bool):
  """A random DecoderLM (local and global layers, sink tokens, untied output) and prompts."""
  cfg = LMConfig(vocab_size=61 if smoke else 512, d_model=32 if smoke else 128, num_heads=4,
                 num_kv_heads=2, num_layers=2 if smoke else 4, d_ff=64 if smoke else 512,
                 local_window=8 if smoke else 32, sink_tokens=2, tie_embeddings=False)
  model = DecoderLM(cfg)
  prompts = jax.random.randint(jax.random.key(1), (4, 16), 0, cfg.vocab_size)
  lengths = jnp.array([16, 11, 7, 13], jnp.int32)
  return model, jax.jit(model.init)(jax.random.key(0), prompts), prompts, lengths


def trained_lm(workdir: str):
  """The newest checkpoint of a run of experiments.train (an LM) and 4 held-out prompts."""
  from experiments import generate  # pylint: disable=import-outside-toplevel
  from experiments import lm_data  # pylint: disable=import-outside-toplevel
  runner, params = generate.restore_params(workdir)
  prompts, lengths = lm_data.prompts(runner.task, runner.pairs[:4], runner.prompt_room)
  return runner.model, {"params": params}, jnp.asarray(prompts), jnp.asarray(lengths)


def hf_checkpoint(directory: str):
  """A Hugging Face checkpoint (float32) and 4 random prompts of 16 tokens of its vocabulary."""
  from flax_mha.models import hf  # pylint: disable=import-outside-toplevel
  model, params = hf.load(directory, dtype=jnp.float32)
  prompts = jax.random.randint(jax.random.key(2), (4, 16), 3, model.config.vocab_size)
  return model, params, prompts, jnp.full((4,), 16, jnp.int32)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, a few tokens")
  parser.add_argument("--workdir", default=None, help="a trained LM run (experiments.train)")
  parser.add_argument("--hf", nargs="*", default=(), help="Hugging Face checkpoint directories")
  args = parser.parse_args()
  shapes = ((64,), (64,)) if args.smoke else ((64, 128), (512, 4096))
  print("attention: one step over S random slots, |int8 - float32| of the output")
  for k_dim in shapes[0]:
    for slots in shapes[1]:
      worst, median = attention_errors(k_dim, slots)
      print(f"  K={k_dim:3d} S={slots:5d}: max {worst:.2e}, median row max {median:.2e}")
  print("bytes per token and key/value head (keys and values)")
  for k_dim in (64, 128, 256):
    per = pool_bytes(k_dim)
    print(f"  K={k_dim:3d}: float32 {per['float32']:.0f}, bfloat16 {per['bfloat16']:.0f}, "
          f"int8 {per['int8']:.0f} ({per['int8'] / per['float32']:.3f} of float32, "
          f"{per['int8'] / per['bfloat16']:.3f} of bfloat16)")
  new_tokens = 8 if args.smoke else NEW_TOKENS
  models = [("random DecoderLM", lambda: random_lm(args.smoke))]
  if args.workdir:
    models.append((f"trained LM {args.workdir}", lambda: trained_lm(args.workdir)))
  models += [(f"hf {d}", lambda d=d: hf_checkpoint(d)) for d in args.hf]
  print(f"models: {new_tokens} greedy tokens, float32 cache against int8")
  for name, load in models:
    found = compare_model(*load(), new_tokens)
    print(f"  {name}: same tokens per row {found['same']} of {new_tokens}, until the first "
          f"change {found['until_first_change']}; logits max err "
          f"{found['logits_max_err']:.2e} (max |logit| {found['logits_scale']:.1f})")


if __name__ == "__main__":
  main()
