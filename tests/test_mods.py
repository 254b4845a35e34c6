"""Windows, sequence lengths, segment ids, soft-capping, mask_mod and score_mod, in every
implementation: against jax.nn, torch's FlexAttention (forward), the oracle (gradients) and a
float64 NumPy reference; and the tiles the chunked kernel visits.
"""

from __future__ import annotations

import functools
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_mha
from flax_mha.kernels import chunked
from flax_mha import mods as mods_lib
from conftest import np_attention

B, T, H, G, K = 2, 37, 4, 2, 8  # T prime: no block size divides it
SMALL = chunked.make_attention(block_q=8, block_k=4)
IMPLS = {"reference": "reference", "xla": "xla", "chunked": "chunked", "chunked_small": SMALL}
SEGMENTS = np.array([[0] * 9 + [1] * 20 + [2] * 8, [0] * 30 + [5] * 7])
LENGTHS = np.array([30, 37])


def _qkv(seed=0, t=T, s=T, dtype=np.float32):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal(shape), dtype)
               for shape in ((B, t, H, K), (B, s, G, K), (B, s, G, K)))


def _np_visible(t, s, *, causal=False, window=None, q_len=None, kv_len=None, q_seg=None,
                kv_seg=None):
  """[B, 1, T, S] visibility written out in NumPy."""
  q, kv = np.arange(t)[:, None], np.arange(s)[None, :]
  visible = np.ones((B, 1, t, s), bool)
  if causal:
    visible &= q >= kv
  if window is not None:
    visible &= (kv >= q - window[0]) & (kv <= q + window[1])
  if q_len is not None:
    visible &= (q[None, None] < q_len[:, None, None, None])
    visible &= (kv[None, None] < kv_len[:, None, None, None])
  if q_seg is not None:
    visible &= q_seg[:, None, :, None] == kv_seg[:, None, None, :]
  return visible


OPTION_CASES = {  # name -> (keyword arguments, the same as a NumPy visibility)
    "window": (dict(local_window_size=(5, 3)), dict(window=(5, 3))),
    "window_causal": (dict(local_window_size=6, is_causal=True), dict(window=(6, 6), causal=True)),
    "lengths": (dict(query_seq_lengths=LENGTHS, key_value_seq_lengths=LENGTHS),
                dict(q_len=LENGTHS, kv_len=LENGTHS)),
    "segments": (dict(q_segment_ids=SEGMENTS), dict(q_seg=SEGMENTS, kv_seg=SEGMENTS)),
    "segments_causal_window": (dict(q_segment_ids=SEGMENTS, is_causal=True, local_window_size=7),
                               dict(q_seg=SEGMENTS, kv_seg=SEGMENTS, causal=True, window=(7, 7))),
}


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("case", sorted(OPTION_CASES))
def test_options_match_numpy_and_the_oracle_gradients(impl, case):
  kwargs, np_kwargs = OPTION_CASES[case]
  q, k, v = _qkv(1)
  fn = functools.partial(flax_mha.dot_product_attention, **kwargs)
  out = jax.jit(lambda q, k, v: fn(q, k, v, implementation=IMPLS[impl]))(q, k, v)
  want = np_attention(q, k, v, mask=_np_visible(T, T, **np_kwargs))
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
  loss = lambda name: lambda *a: jnp.sum(jnp.sin(fn(*a, implementation=name)))
  grads = jax.jit(jax.grad(loss(IMPLS[impl]), argnums=(0, 1, 2)))(q, k, v)
  chex.assert_trees_all_close(grads, jax.grad(loss("reference"), argnums=(0, 1, 2))(q, k, v),
                              atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", ["reference", "xla", "chunked", "chunked_small"])
@pytest.mark.parametrize("kwargs", [
    dict(local_window_size=(5, 3)), dict(local_window_size=4, is_causal=True),
    dict(query_seq_lengths=LENGTHS, key_value_seq_lengths=LENGTHS),
    dict(key_value_seq_lengths=LENGTHS, is_causal=True)], ids=["window", "window_causal",
                                                               "lengths", "kv_lengths_causal"])
def test_matches_jax_nn(impl, kwargs):
  """jax.nn.dot_product_attention's own options: equal outputs and gradients on the query rows
  jax.nn defines alike (jax.nn gives padded query rows the mean of V; we give them 0)."""
  q, k, v = _qkv(2)
  rows = np.ones((B, T, 1, 1), np.float32)
  if "query_seq_lengths" in kwargs:
    rows = (np.arange(T)[None, :] < LENGTHS[:, None]).astype(np.float32)[..., None, None]
  jnp_kwargs = {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kwargs.items()}
  ours = lambda q, k, v: flax_mha.dot_product_attention(q, k, v, implementation=IMPLS[impl],
                                                        **jnp_kwargs) * rows
  peer = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **jnp_kwargs) * rows
  np.testing.assert_allclose(jax.jit(ours)(q, k, v), peer(q, k, v), atol=2e-5, rtol=2e-5)
  loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
  chex.assert_trees_all_close(jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v),
                              jax.grad(loss(peer), argnums=(0, 1, 2))(q, k, v),
                              atol=5e-5, rtol=5e-5)


def _torch_flex(q, k, v, mask_mod=None, score_mod=None):
  """torch's FlexAttention forward (CPU) in our [B, T, H, K] layout."""
  torch = pytest.importorskip("torch")
  from torch.nn.attention import flex_attention as flex  # pylint: disable=import-outside-toplevel
  tq, tk, tv = (torch.tensor(np.asarray(x).transpose(0, 2, 1, 3)) for x in (q, k, v))
  block = None
  if mask_mod is not None:
    block = flex.create_block_mask(mask_mod, B=B, H=None, Q_LEN=q.shape[1], KV_LEN=k.shape[1],
                                   device="cpu")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    out = flex.flex_attention(tq, tk, tv, block_mask=block, score_mod=score_mod, enable_gqa=True)
  return out.numpy().transpose(0, 2, 1, 3)


def _flex_cases():
  """name -> (our kwargs, torch mask_mod, torch score_mod): the same function written twice."""
  import torch  # pylint: disable=import-outside-toplevel
  doc_j, doc_t = jnp.asarray(SEGMENTS), torch.tensor(SEGMENTS)
  slopes_j = jnp.asarray([2.0 ** -(i + 1) for i in range(H)])
  slopes_t = torch.tensor(np.asarray(slopes_j))
  table = np.random.default_rng(3).standard_normal(2 * T - 1).astype(np.float32)
  table_j, table_t = jnp.asarray(table), torch.tensor(table)
  return {
      "sliding_window": (dict(mask_mod=lambda b, h, q, kv: (q >= kv) & (q - kv <= 8)),
                         lambda b, h, q, kv: (q >= kv) & (q - kv <= 8), None),
      "document": (dict(mask_mod=lambda b, h, q, kv: doc_j[b, q] == doc_j[b, kv]),
                   lambda b, h, q, kv: doc_t[b, q] == doc_t[b, kv], None),
      "soft_cap": (dict(score_mod=lambda s, b, h, q, kv: 3.0 * jnp.tanh(s / 3.0)), None,
                   lambda s, b, h, q, kv: 3.0 * torch.tanh(s / 3.0)),
      "soft_cap_builtin": (dict(logit_soft_cap=3.0), None,
                           lambda s, b, h, q, kv: 3.0 * torch.tanh(s / 3.0)),
      "alibi": (dict(score_mod=lambda s, b, h, q, kv: s + slopes_j[h] * (kv - q), is_causal=True),
                lambda b, h, q, kv: q >= kv,
                lambda s, b, h, q, kv: s + slopes_t[h] * (kv - q)),
      "relative_bias": (dict(score_mod=lambda s, b, h, q, kv: s + table_j[q - kv + T - 1]), None,
                        lambda s, b, h, q, kv: s + table_t[q - kv + T - 1]),
  }


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("case", ["sliding_window", "document", "soft_cap", "soft_cap_builtin",
                                  "alibi", "relative_bias"])
def test_matches_torch_flex_attention(impl, case):
  pytest.importorskip("torch")
  kwargs, mask_mod, score_mod = _flex_cases()[case]
  q, k, v = _qkv(4)
  out = flax_mha.dot_product_attention(q, k, v, implementation=IMPLS[impl], **kwargs)
  np.testing.assert_allclose(out, _torch_flex(q, k, v, mask_mod, score_mod), atol=2e-5,
                             rtol=2e-5)


@pytest.mark.parametrize("impl", ["xla", "chunked", "chunked_small"])
def test_score_mod_arrays_get_gradients(impl):
  """A learned relative-position table closed over by score_mod: its gradient through every
  implementation equals the oracle's, and the oracle's equals finite differences in float64."""
  q, k, v = _qkv(5)
  table = jnp.asarray(np.random.default_rng(6).standard_normal(2 * T - 1), jnp.float32)

  def loss(table, q, name):
    mod = lambda s, b, h, qi, kv: s + table[qi - kv + T - 1]
    out = flax_mha.dot_product_attention(q, k, v, is_causal=True, score_mod=mod,
                                         implementation=name)
    return jnp.sum(jnp.sin(out))

  got = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(table, q, IMPLS[impl])
  want = jax.grad(loss, argnums=(0, 1))(table, q, "reference")
  chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)
  with jax.enable_x64(True):
    q64, t64 = q.astype(jnp.float64), table.astype(jnp.float64)
    k64, v64 = k.astype(jnp.float64), v.astype(jnp.float64)
    mod = lambda t: lambda s, b, h, qi, kv: s + jnp.asarray(t)[qi - kv + T - 1]
    f = lambda t: flax_mha.dot_product_attention(q64[:1, :9], k64[:1, :9], v64[:1, :9],
                                                 is_causal=True, score_mod=mod(t),
                                                 implementation="reference")
    jax.test_util.check_grads(f, (t64,), order=1, modes=["rev"])


def test_soft_cap_and_score_mod_match_numpy_float64():
  with jax.enable_x64(True):
    q, k, v = _qkv(7, dtype=np.float64)
    out = flax_mha.dot_product_attention(
        q, k, v, logit_soft_cap=2.5, score_mod=lambda s, b, h, qi, kv: s - 0.05 * (qi - kv),
        is_causal=True, implementation="chunked")
    qn, kn = np.asarray(q), np.repeat(np.asarray(k), H // G, axis=2)
    scores = np.einsum("bthk,bshk->bhts", qn, kn) / np.sqrt(K)
    scores = scores - 0.05 * (np.arange(T)[:, None] - np.arange(T)[None, :])
    scores = 2.5 * np.tanh(scores / 2.5)
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    want = np.einsum("bhts,bshv->bthv", weights, np.repeat(np.asarray(v), H // G, axis=2))
    np.testing.assert_allclose(out, want, atol=1e-12, rtol=1e-12)


def _visits(t, s, bq, bk, mods, mask=None):
  q = jnp.zeros((B, t, H, K))
  cfg = chunked._Config(1.0, 0.0, bq, bk)  # pylint: disable=protected-access
  ctx = chunked._context(q, q[:, :s], None, mask, None, mods, cfg, 0, 0)  # pylint: disable=protected-access
  return np.asarray(ctx.rows.full_count), np.asarray(ctx.rows.partial_count), ctx.rows


def test_tiles_causal_window_are_known_at_trace_time():
  """Causal over 8 x 8 tiles: 28 below the diagonal unmasked, 8 on it masked, 28 skipped; a
  window of 16 keeps only the band; a mask_mod spelling causality gives causal's tiles."""
  full, partial, rows = _visits(64, 64, 8, 8, mods_lib.with_causal(None, True))
  assert isinstance(rows.full_count, np.ndarray)  # static: computed while tracing
  assert full.sum() == 28 and partial.sum() == 8
  full, partial, _ = _visits(64, 64, 8, 8, mods_lib.Mods((mods_lib.LocalWindow(16, 0),)))
  assert (full + partial).max() <= 4 and full.sum() + partial.sum() < 64 * 0.5
  spelled = mods_lib.Mods((mods_lib.MaskMod(lambda b, h, q, kv: q >= kv),))
  full2, partial2, rows2 = _visits(64, 64, 8, 8, spelled)
  assert isinstance(rows2.full_count, np.ndarray)
  assert full2.sum() == 28 and partial2.sum() == 8


def test_tiles_of_segments_come_from_min_max_at_run_time():
  """Two documents of 32 in 64 tokens, 8 x 8 tiles: the 2 x 16 same-document tiles are all
  visible and nothing else is visited."""
  ids = jnp.asarray(np.repeat([[0, 1]], B, axis=0).repeat(32, axis=1))
  full, partial, rows = _visits(64, 64, 8, 8, mods_lib.Mods((mods_lib.Segments(ids, ids),)))
  assert not isinstance(rows.full_count, np.ndarray)
  assert full.sum() == 32 and partial.sum() == 0


def test_dense_mask_tiles_are_skipped():
  mask = jnp.zeros((B, 1, 1, 64), bool).at[..., :16].set(True)  # key padding: 16 real keys
  full, partial, _ = _visits(64, 64, 8, 8, mods_lib.Mods(), mask=mask)
  assert full.sum() == 8 * 2 and partial.sum() == 0


def test_segment_ids_memory_is_linear():
  """fwd+bwd with segment ids at N=16384, H=1: XLA temp memory far below the [T, S] matrix."""
  n = 16384
  x = jax.ShapeDtypeStruct((1, n, 1, 64), jnp.float32)
  ids = jax.ShapeDtypeStruct((1, n), jnp.int32)
  loss = lambda q, k, v, ids: jnp.sum(flax_mha.dot_product_attention(
      q, k, v, q_segment_ids=ids, implementation="chunked"))
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x, ids).compile()
  assert compiled.memory_analysis().temp_size_in_bytes < 64 * 2**20  # [T, S] f32: 1 GiB


BAD = [
    (dict(local_window_size=3), dict(s=T + 2), ValueError, "local_window_size needs T == S"),
    (dict(local_window_size=(-1, 2)), {}, ValueError, "local_window_size must be an int >= 0"),
    (dict(q_segment_ids=SEGMENTS[:, :5]), {}, ValueError,
     r"q_segment_ids must broadcast to \[\.\.\., T\] = \(2, 37\), got shape \(2, 5\)"),
    (dict(q_segment_ids=SEGMENTS.astype(np.float32)), {}, TypeError,
     "q_segment_ids must have an integer dtype, got float32"),
    (dict(q_segment_ids=SEGMENTS), dict(s=T + 2), ValueError,
     "q_segment_ids and kv_segment_ids must both be given when T != S"),
    (dict(query_seq_lengths=np.array([1.0, 2.0])), {}, TypeError,
     "query_seq_lengths must have an integer dtype"),
    (dict(key_value_seq_lengths=np.array([1, 2, 3])), {}, ValueError,
     r"key_value_seq_lengths must broadcast to \[\.\.\.\] \(the batch dims\) = \(2,\)"),
    (dict(logit_soft_cap=0.0), {}, ValueError, "logit_soft_cap must be a finite number > 0"),
    (dict(logit_soft_cap=-1.0), {}, ValueError, "logit_soft_cap must be a finite number > 0"),
    (dict(logit_soft_cap="3"), {}, TypeError, "logit_soft_cap must be a finite number > 0, got str"),
    (dict(mask_mod=lambda b, h, q, kv: (q - kv).astype(jnp.float32)), {}, TypeError,
     "mask_mod must return a boolean array"),
    (dict(mask_mod=3), {}, TypeError, "mask_mod must be a callable"),
    (dict(score_mod=lambda s, b, h, q, kv: s > 0), {}, TypeError,
     "score_mod must map a scalar score to a floating scalar"),
]


@pytest.mark.parametrize("kwargs,shape,error,match", BAD, ids=[m for *_, m in BAD])
def test_bad_options_are_named_errors(kwargs, shape, error, match):
  q, k, v = _qkv(8, **shape)
  with pytest.raises(error, match=match):
    flax_mha.dot_product_attention(q, k, v, **kwargs)


def test_cudnn_refuses_options_by_name():
  q, k, v = _qkv(9)
  with pytest.raises(ValueError, match="implementation='cudnn' cannot run"):
    flax_mha.dot_product_attention(q, k, v, local_window_size=3, implementation="cudnn")


def test_weights_take_the_options():
  q, k, _ = _qkv(10)
  weights = flax_mha.dot_product_attention_weights(q, k, q_segment_ids=SEGMENTS,
                                                   logit_soft_cap=2.0)
  visible = _np_visible(T, T, q_seg=SEGMENTS, kv_seg=SEGMENTS)
  assert np.all(np.asarray(weights)[~np.broadcast_to(visible, weights.shape)] == 0)
  np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
  with pytest.raises(TypeError, match="unexpected keyword arguments"):
    flax_mha.dot_product_attention_weights(q, k, implementation="xla")
