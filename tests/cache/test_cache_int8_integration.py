"""The int8 KV cache at the cases tests/cache/test_cache_int8.py leaves out (each a few compiles): the
rolling and paged caches' steps, the Triton decode kernel in Pallas interpret mode (a cache's
step and a paged one), a prefill and a named implementation, jit, vmap and gradients; and
generation with `cache_dtype=jnp.int8` (linen and NNX DecoderLMs, beam search, the paged
caches of serving) against the float cache's."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_mha
from flax_mha import cache as cache_lib
from flax_mha import call_options
from flax_mha import dispatch
from flax_mha import quant
from flax_mha.kernels import decode
from flax_mha.models import decoding
from flax_mha.models import lm_nnx
from flax_mha.models.lm import DecoderLM, LMConfig
from flax_mha.models import transformer
from flax_mha.models.transformer import Transformer, TransformerConfig

import test_cache_int8 as unit
from helpers import output_and_grads
from test_cache_int8 import B, G, H, K, V, INTERPRETED, KINDS
from test_cache_int8 import filled, jit_step, shared_oracle, oracle_graph, step_inputs

pytestmark = pytest.mark.integration  # seconds of compiles per case


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_int8_step_equals_the_dequantized_oracle_and_nears_the_float_cache(kind):
  unit.check_step(kind, near_float=True)


@pytest.mark.parametrize("kind", ["full", "paged"])
def test_triton_decode_interpreted_reads_int8(kind):
  """The Triton decode kernel (Pallas interpret mode) loads int8 blocks and their scales, and
  dequantizes a non-finite entry's code as `quant.dequantize` does."""
  options = KINDS[kind][1]
  q, k, v = step_inputs(t=1)
  cache = filled(kind, jnp.int8)
  got = jit_step(dict(options, implementation=INTERPRETED))(cache, q, k, v)[0]
  chex.assert_trees_all_close(got, shared_oracle(cache, q, k, v, options), atol=2e-5)
  unit.check_non_finite_value(kind, [INTERPRETED])  # an inf entry stays where it was


def test_a_prefill_and_a_named_implementation():
  """Past FEW_QUERIES queries, or with a dense implementation named, the keys handed to
  dot_product_attention are the dequantized cache's; "decode" named reads the slots in place
  whatever T."""
  cache = filled("full", jnp.int8)
  q, k, v = step_inputs(t=dispatch.FEW_QUERIES + 1, seed=3)
  want = shared_oracle(cache, q, k, v, {})
  for options in (dict(), dict(implementation="xla"), dict(implementation="decode")):
    chex.assert_trees_all_close(jit_step(options)(cache, q, k, v)[0], want, atol=2e-5)


def test_jit_vmap_and_the_querys_gradient():
  """A step jitted and vmapped over two caches equals it over each alone; its gradient with
  respect to the query equals the oracle's, and through the keys written it raises."""
  cache = filled("full", jnp.int8)
  q, k, v = step_inputs(t=1)
  step = lambda c, q, k, v: cache_lib.attend(q, k, v, c)[0]
  other = cache.put_row(0, cache.take_row(1)).put_row(1, cache.take_row(0))
  both = jax.tree.map(lambda a, b: jnp.stack([a, b]), cache, other)
  stacked = jax.jit(jax.vmap(step, in_axes=(0, None, None, None)))(both, q, k, v)
  for alone, c in zip(stacked, (cache, other)):
    chex.assert_trees_all_close(alone, shared_oracle(c, q, k, v, {}), atol=2e-5)
  loss = lambda f: lambda q: jnp.sum(jnp.sin(f(q)))
  got = jax.jit(jax.grad(loss(lambda q: step(cache, q, k, v))))(q)
  want = jax.jit(jax.grad(loss(lambda q: oracle_graph(cache, q, k, v, {}, True))))(q)
  chex.assert_trees_all_close(got, want, atol=2e-5)
  with pytest.raises(TypeError, match="quantize has no derivative"):
    jax.grad(lambda k: jnp.sum(step(cache, q, k, v)))(k)


def test_gradients_reach_the_query_and_the_scales():
  """Of a step over a full or a paged int8 cache (the xla step's backward through the
  dequantized prefix; the decode kernel's over the dequantized pages), plain and under
  jax.checkpoint: the query's and the scales' gradients equal the oracle's."""
  for kind, scales in (("full", ("key_scale", "value_scale")), ("paged", ("k_scales",
                                                                           "v_scales"))):
    cache = filled(kind, jnp.int8)
    q, k, v = step_inputs(t=2)
    options = KINDS[kind][1]

    def loss(fn):
      def of(q, *scale_arrays):
        c = dataclasses.replace(cache, **dict(zip(scales, scale_arrays)))
        return jnp.sum(jnp.sin(fn(c, q)))
      return jax.jit(jax.grad(of, argnums=(0, 1, 2)))

    args = (q, *(getattr(cache, name) for name in scales))
    step = lambda c, q: cache_lib.attend(q, k, v, c, **options)[0]
    want = loss(lambda c, q: oracle_graph(c, q, k, v, options, True))(*args)
    for got in (loss(step)(*args), loss(jax.checkpoint(step))(*args)):  # and rematerialised
      for g, w in zip(got, want):  # float32 sums of large terms: tolerance by the largest
        np.testing.assert_allclose(g, w, atol=2e-5 * max(1.0, float(jnp.max(jnp.abs(w)))))


def _lm_config(**overrides):
  """A small LM with a local layer (rolling cache, sink tokens) and a global one; an untied
  output projection, so that a random model's greedy tokens vary."""
  return LMConfig(**dict(dict(vocab_size=61, d_model=32, num_heads=4, num_kv_heads=2,
                              num_layers=2, d_ff=64, local_window=5, sink_tokens=2,
                              tie_embeddings=False), **overrides))


PROMPTS = jnp.asarray(np.random.default_rng(0).integers(0, 61, (3, 9)), jnp.int32)
LENGTHS = jnp.asarray([9, 4, 6], jnp.int32)


def test_generate_with_an_int8_cache_flips_only_near_ties():
  """Greedy tokens over int8 caches (linen DecoderLM) are the float cache's until a step where
  the float model's two best logits lie within 0.05 (there the int8 cache may pick the second);
  the caches made are int8; the NNX twin on the same weights gives the linen model's tokens;
  beam search runs over int8 caches."""
  lm = DecoderLM(_lm_config())
  params = lm.init(jax.random.key(0), PROMPTS)
  caches = lm.apply(params, PROMPTS, 8, jnp.int8, method=DecoderLM.init_cache)
  assert all(c.key.dtype == jnp.int8 and c.key_scale.dtype == jnp.float32 for c in caches)
  run = lambda model, params, **kw: decoding.generate(
      model, params, (PROMPTS,), PROMPTS, LENGTHS, max_new_tokens=12, **kw)
  want, got = run(lm, params), run(lm, params, cache_dtype=jnp.int8)
  assert len(np.unique(np.asarray(want))) > 3  # not a degenerate repetition
  assert (got == want).mean() >= 0.9  # measured here: 35 of 36
  for row, length in enumerate(np.asarray(LENGTHS)):
    differ = np.flatnonzero(got[row] != want[row])
    if differ.size:  # the float model's logits after the tokens both chose
      n = differ[0]
      prefix = jnp.concatenate([PROMPTS[row, :length], want[row, :n]])[None]
      logits = lm.apply(params, prefix)[0, -1]
      second, best = jnp.sort(logits)[-2:]
      assert float(best - second) < 0.05 and got[row, n] == jnp.argsort(logits)[-2]
  twin = lm_nnx.load_linen_params(lm_nnx.DecoderLM(_lm_config(), rngs=nnx.Rngs(0)), params)
  np.testing.assert_array_equal(run(twin, None, cache_dtype=jnp.int8), got)
  beam = lambda **kw: decoding.generate_beam(lm, params, (PROMPTS,), PROMPTS, LENGTHS,
                                             max_new_tokens=4, beam_size=2, **kw)
  np.testing.assert_array_equal(beam(cache_dtype=jnp.int8), beam())  # measured: no flip here
  with pytest.raises(TypeError, match="cache_dtype: dtype must be a floating dtype or int8"):
    run(lm, params, cache_dtype=jnp.int16)


def test_paged_int8_caches_of_a_model_near_the_float_ones():
  """`init_paged_cache(..., dtype=jnp.int8)` (serving's caches: int8 pages for the global
  layer, an int8 rolling cache for the local one): a prefill and steps give logits within
  0.05 of the float caches' and the same greedy tokens."""
  lm = DecoderLM(_lm_config())
  params = lm.init(jax.random.key(0), PROMPTS)
  table = jnp.arange(3 * 2, dtype=jnp.int32).reshape(3, 2)

  @jax.jit
  def run(caches):
    caches = tuple(c.with_table(table) for c in caches)
    positions = jnp.where(jnp.arange(9) < LENGTHS[:, None], jnp.arange(9), -1)
    logits, caches = lm.apply(params, PROMPTS, caches, positions, method=DecoderLM.logits)
    out = [jnp.take_along_axis(logits, (LENGTHS - 1)[:, None, None], axis=1)[:, 0]]
    for _ in range(3):
      logits, caches = lm.apply(params, jnp.argmax(out[-1], -1)[:, None], caches,
                                method=DecoderLM.logits)
      out.append(logits[:, 0])
    return jnp.stack(out, 1)

  make = lambda dtype: lm.apply(params, 3, 8, 16, 2, dtype, method=DecoderLM.init_paged_cache)
  int8_caches = make(jnp.int8)
  assert isinstance(int8_caches[1], cache_lib.PagedKVCache) and int8_caches[1].k_scales is not None
  got, want = run(int8_caches), run(make(jnp.float32))
  assert float(jnp.max(jnp.abs(got - want))) < 0.05
  np.testing.assert_array_equal(jnp.argmax(got, -1), jnp.argmax(want, -1))


@pytest.mark.parametrize("kind", ["full", "rolling_sink_tokens"])
def test_the_decode_kernel_over_a_float_caches_slots(kind):
  """implementation="decode" over a float cache reads its slots in place (the step entry that
  int8 caches take): values and gradients equal the xla step's."""
  options = KINDS[kind][1]
  cache = filled(kind, jnp.float32)
  step = lambda extra: lambda q, k, v: cache_lib.attend(q, k, v, cache, **options, **extra)[0]
  args = step_inputs(t=2)
  got = output_and_grads(step(dict(implementation="decode")), *args)
  chex.assert_trees_all_close(got, output_and_grads(step({}), *args), atol=2e-5, rtol=2e-5)


def test_the_decode_kernel_over_slots_that_no_block_divides():
  """`decode.cache` with blocks of 16 over 41 int8 slots (the last block gathered, clamped,
  its slots past S hidden) equals the reference over the dequantized slots."""
  s, t = 41, 2
  q, k, v = step_inputs(t=t, seed=4)[0], *unit.arrays(5, (B, G, s, K), (B, G, s, V))
  (k, k_scale), (v, v_scale) = quant.quantize(k), quant.quantize(v)
  kv_pos = jnp.where(jnp.arange(s) < jnp.asarray([[30], [41]]), jnp.arange(s), -1)
  q_pos = jnp.asarray([[28, 29], [39, 40]])
  mods, _ = call_options.build((B,), t, s, H, jnp.float32, True, q_positions=q_pos,
                               kv_positions=kv_pos)
  cfg, cfg_bwd = decode.configs(K ** -0.5, 0.0, t, s, K, 16)
  out, _ = jax.jit(lambda q: decode.cache(q, k, v, mods, cfg, cfg_bwd, 2,
                                          kv_scales=(k_scale, v_scale)))(q)
  api = lambda x, scale: quant.dequantize(x, scale).transpose(0, 2, 1, 3)
  want = flax_mha.dot_product_attention(q, api(k, k_scale), api(v, v_scale), is_causal=True,
                                        q_positions=q_pos, kv_positions=kv_pos,
                                        implementation="reference")
  chex.assert_trees_all_close(out, want, atol=2e-5)


def test_the_encoder_decoder_decodes_over_int8_caches():
  """`greedy_decode(..., cache_dtype=jnp.int8)` of the Transformer: its decoder's caches int8,
  the tokens the float caches give on these sources (measured: no flip here)."""
  cfg = TransformerConfig(vocab_size=11, d_model=32, num_heads=2, d_ff=48, dropout_rate=0.0,
                          max_len=12)
  src = jnp.asarray(np.random.default_rng(0).integers(3, 11, (3, 6)), jnp.int32)
  params = Transformer(cfg).init(jax.random.key(0), src, src[:, :2])["params"]
  int8 = transformer.greedy_decode(cfg, params, src, max_len=8, cache_dtype=jnp.int8)
  np.testing.assert_array_equal(int8, transformer.greedy_decode(cfg, params, src, max_len=8))
