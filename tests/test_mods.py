"""flax_mha.mods: windows, sequence lengths, segment ids, soft-capping, mask_mod and score_mod, in
every implementation: against jax.nn, torch's FlexAttention (forward), the oracle (gradients) and
a float64 NumPy reference; under scan, checkpoint and vmap; -inf logits and mods refused by name.
The tiles the chunked kernel visits for them are in tests/kernels/test_chunked.py; the cases
left to the integration part and the slow ones (chunked at every option) in
tests/test_mods_integration.py.
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
from helpers import in_turn, np_attention, output_and_grads, split_grid

B, T, H, G, K = 2, 37, 4, 2, 8  # T prime: no block size divides it
SMALL = chunked.make_attention(block_q=8, block_k=4)
IMPLS = {"reference": "reference", "xla": "xla", "chunked": "chunked", "chunked_small": SMALL}


def impl_params(impls):
  """The names of `impls` but "chunked": at these lengths it picks one tile (default blocks are
  >= 128), chunked_small's kernel with a single trip; the unit suite keeps chunked_small (many
  tiles and padding), and a chunked compile costs seconds (chunked: test_mods_integration.py,
  slow)."""
  return [name for name in sorted(impls) if name != "chunked"]


def each_case_twice(cases):
  """(impl, case) pairs of `impl_params(IMPLS)` and `cases` for the unit suite: each case with
  all implementations but one, in turn (each implementation still meets most cases); the
  left-out pairs and chunked's: `later_cases`, the integration part (slow)."""
  names = impl_params(IMPLS)
  left_out = in_turn(cases, names)
  return [(impl, case) for case in cases for impl in names if not left_out(case, impl)]


def later_cases(cases):
  """The (impl, case) pairs `each_case_twice` leaves out, chunked's among them."""
  kept = set(each_case_twice(cases))
  return [(impl, case) for case in cases for impl in sorted(IMPLS) if (impl, case) not in kept]


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


@pytest.mark.parametrize("impl,case", each_case_twice(sorted(OPTION_CASES)))
def test_options_match_numpy_and_the_oracle_gradients(impl, case):
  kwargs, np_kwargs = OPTION_CASES[case]
  q, k, v = _qkv(1)
  fn = lambda name: functools.partial(flax_mha.dot_product_attention, implementation=name,
                                      **kwargs)
  out, grads = output_and_grads(fn(IMPLS[impl]), q, k, v)  # one compile: values and gradients
  want = np_attention(q, k, v, mask=_np_visible(T, T, **np_kwargs))
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
  _, want_grads = output_and_grads(fn("reference"), q, k, v, jit=False)
  chex.assert_trees_all_close(grads, want_grads, atol=2e-5, rtol=2e-5)


JAX_NN_OPTIONS = {
    "window": dict(local_window_size=(5, 3)),
    "window_causal": dict(local_window_size=4, is_causal=True),
    "lengths": dict(query_seq_lengths=LENGTHS, key_value_seq_lengths=LENGTHS),
    "kv_lengths_causal": dict(key_value_seq_lengths=LENGTHS, is_causal=True)}


@pytest.mark.parametrize("impl,case", each_case_twice(list(JAX_NN_OPTIONS)))
def test_matches_jax_nn(impl, case):
  """jax.nn.dot_product_attention's own options: equal outputs and gradients on the query rows
  jax.nn defines alike (jax.nn gives padded query rows the mean of V; we give them 0)."""
  kwargs = JAX_NN_OPTIONS[case]
  q, k, v = _qkv(2)
  rows = np.ones((B, T, 1, 1), np.float32)
  if "query_seq_lengths" in kwargs:
    rows = (np.arange(T)[None, :] < LENGTHS[:, None]).astype(np.float32)[..., None, None]
  jnp_kwargs = {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kwargs.items()}
  ours = lambda q, k, v: flax_mha.dot_product_attention(q, k, v, implementation=IMPLS[impl],
                                                        **jnp_kwargs) * rows
  peer = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **jnp_kwargs) * rows
  out, grads = output_and_grads(ours, q, k, v)  # one compile: values and gradients
  want, want_grads = output_and_grads(peer, q, k, v, jit=False)
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
  chex.assert_trees_all_close(grads, want_grads, atol=5e-5, rtol=5e-5)


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


FLEX_CASES = ["sliding_window", "document", "soft_cap", "alibi"]
LATER_FLEX_CASES = ["soft_cap_builtin", "relative_bias"]  # in the integration part


@pytest.mark.parametrize("impl,case", each_case_twice(FLEX_CASES))
def test_matches_torch_flex_attention(impl, case):
  pytest.importorskip("torch")
  kwargs, mask_mod, score_mod = _flex_cases()[case]
  q, k, v = _qkv(4)
  out = flax_mha.dot_product_attention(q, k, v, implementation=IMPLS[impl], **kwargs)
  np.testing.assert_allclose(out, _torch_flex(q, k, v, mask_mod, score_mod), atol=2e-5,
                             rtol=2e-5)


@pytest.mark.parametrize("impl", impl_params(["xla", "chunked", "chunked_small"]))
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
  """The score_mod is a bias by distance, added before the cap: the NumPy reference's bias."""
  with jax.enable_x64(True):
    q, k, v = _qkv(7, dtype=np.float64)
    out = flax_mha.dot_product_attention(
        q, k, v, logit_soft_cap=2.5, score_mod=lambda s, b, h, qi, kv: s - 0.05 * (qi - kv),
        is_causal=True, implementation="chunked")
    distance_TS = np.arange(T)[:, None] - np.arange(T)[None, :]
    want = np_attention(q, k, v, -0.05 * distance_TS, soft_cap=2.5, is_causal=True)
    np.testing.assert_allclose(out, want, atol=1e-12, rtol=1e-12)


BAD = [
    (dict(local_window_size=3), dict(s=T + 2), ValueError,
     "local_window_size needs T == S.*pass q_positions .* and kv_positions"),
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


def test_weights_take_the_options():
  q, k, _ = _qkv(10)
  weights = flax_mha.dot_product_attention_weights(q, k, q_segment_ids=SEGMENTS,
                                                   logit_soft_cap=2.0)
  visible = _np_visible(T, T, q_seg=SEGMENTS, kv_seg=SEGMENTS)
  assert np.all(np.asarray(weights)[~np.broadcast_to(visible, weights.shape)] == 0)
  np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
  with pytest.raises(TypeError, match="unexpected keyword arguments"):
    flax_mha.dot_product_attention_weights(q, k, implementation="xla")


# ---- under transforms, and what a -inf logit and an odd mod mean (issue 17) ----
#
# Regression tests: mask_mod/score_mod closing over arrays computed inside a `lax.scan` body,
# `jax.checkpoint` or `vmap` (with `jax.grad`) in every implementation that takes mods; a soft cap
# or score_mod never un-hides a key that a -inf bias hides; a mod that is not elementwise, or has
# the wrong signature, is refused naming the argument; windows wider than the sequence; no inf or
# NaN made inside any implementation (`jax.debug_infs`). Query and key length are both L (11).

L = 11  # prime: no block size divides it
IMPLS_L = {**IMPLS, "chunked_small": chunked.make_attention(block_q=3, block_k=4)}
DOCS = np.array([[0] * 4 + [1] * 7, [0] * 9 + [1] * 2], np.int32)


def _layer(x_BTHK, kv_BTGK, docs_BT, table_H, impl):
  """One attention layer whose mask_mod closes over integer ids and whose score_mod closes
  over a float table, both traced values of the caller."""
  return flax_mha.dot_product_attention(
      x_BTHK, kv_BTGK, kv_BTGK, is_causal=True, implementation=impl,
      mask_mod=lambda b, h, q, kv: docs_BT[b, q] == docs_BT[b, kv],
      score_mod=lambda s, b, h, q, kv: s + table_H[h])


def _scan(impl):
  def loss(x, kv, table):
    def body(carry, _):
      docs = jnp.asarray(DOCS) + (jnp.sum(carry) > 1e9).astype(jnp.int32)  # made in the body
      return _layer(carry, kv, docs, table, impl), None
    return jnp.sum(jnp.sin(jax.lax.scan(body, x, None, length=2)[0]))
  return loss


def _checkpoint(impl):
  def loss(x, kv, table):
    layer = jax.checkpoint(lambda x, docs: _layer(x, kv, docs, table, impl))
    return jnp.sum(jnp.sin(layer(x, jnp.asarray(DOCS) * (x[0, 0, 0, 0] < 1e9))))
  return loss


def _vmap(impl):
  def loss(x, kv, table):
    one = lambda x, kv, docs: _layer(x[None], kv[None], docs[None], table, impl)[0]
    return jnp.sum(jnp.sin(jax.vmap(one)(x, kv, jnp.asarray(DOCS))))
  return loss


TRANSFORMS = {"scan": _scan, "checkpoint": _checkpoint, "vmap": _vmap}


TRANSFORM_GRID = split_grid(
    lambda impl, transform: impl == "chunked_small" or (impl == "xla" and transform == "scan"),
    lambda impl, transform: impl == "chunked_small" and transform in ("checkpoint", "vmap"),
    sorted(IMPLS_L), sorted(TRANSFORMS))


@pytest.mark.parametrize("impl,transform", TRANSFORM_GRID.unit)
def test_mods_closing_over_traced_arrays_under_transforms_with_grad(impl, transform):
  """Against the oracle under the same transform (the reference case checks that it runs)."""
  transform = TRANSFORMS[transform]
  q, k, _ = _qkv(1, t=L, s=L)
  table = jnp.asarray([0.3, -0.2, 0.1, 0.5])
  grad = jax.value_and_grad(transform(IMPLS_L[impl]), argnums=(0, 1, 2))
  got = jax.jit(grad)(q, k, table)
  want = jax.value_and_grad(transform("reference"), argnums=(0, 1, 2))(q, k, table)
  chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)
  assert float(jnp.abs(got[1][2]).max()) > 0  # the table's gradient flows


SCORE_TERMS = {"soft_cap": dict(logit_soft_cap=2.0),
               "tanh_score_mod": dict(score_mod=lambda s, b, h, q, kv: 2.0 * jnp.tanh(s / 2.0)),
               "clamping_score_mod": dict(score_mod=lambda s, b, h, q, kv: jnp.maximum(s, -1.0))}


SCORE_TERMS_GRID = split_grid(
    lambda impl, mods: impl == "chunked_small" or (mods == "soft_cap" and impl != "chunked"),
    lambda impl, mods: impl == "chunked_small" and mods == "tanh_score_mod",
    sorted(IMPLS_L), sorted(SCORE_TERMS))


@pytest.mark.parametrize("impl,mods", SCORE_TERMS_GRID.unit)
def test_minus_inf_bias_stays_hidden_through_score_terms(impl, mods):
  """cap·tanh(-inf / cap) = -cap would make a hidden key visible: it must stay hidden, a row
  hidden entirely stays 0, and the bias gradient there is 0."""
  mods = SCORE_TERMS[mods]
  q, k, v = _qkv(2, t=L, s=L)
  bias = np.zeros((B, 1, L, L), np.float32)
  bias[:, :, :, 7:] = -np.inf  # keys 7.. hidden from every query
  bias[0, 0, 3, :] = -np.inf  # query 3 of example 0 sees nothing
  bias = jnp.asarray(bias)
  fn = functools.partial(flax_mha.dot_product_attention, implementation=IMPLS_L[impl], **mods)
  out = fn(q, k, v, bias)
  np.testing.assert_array_equal(out[0, 3], 0.0)
  # The same function with the hidden keys removed: they contribute nothing.
  cut = fn(q, k[:, :7], v[:, :7], jnp.where(jnp.isfinite(bias[..., :7]), 0.0, -jnp.inf))
  np.testing.assert_allclose(out, cut, atol=2e-6, rtol=2e-6)
  dbias = jax.grad(lambda b: jnp.sum(fn(q, k, v, b) ** 2))(bias)
  chex.assert_tree_all_finite(dbias)
  np.testing.assert_array_equal(dbias[..., 7:], 0.0)


@pytest.mark.parametrize("impl", sorted(IMPLS_L))
def test_score_mod_returning_minus_inf_hides_the_key(impl):
  """FlexAttention's idiom: a score_mod may hide a key by returning -inf."""
  q, k, v = _qkv(3, t=L, s=L)
  mod = lambda s, b, h, q, kv: jnp.where(kv > q, -jnp.inf, s)
  out = flax_mha.dot_product_attention(q, k, v, score_mod=mod, implementation=IMPLS_L[impl])
  np.testing.assert_allclose(out, np_attention(q, k, v, is_causal=True), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", ["reference", None, "chunked", "chunked_small"])
def test_dense_array_as_mask_mod_is_refused_by_name(impl):
  dense_TS = jnp.tril(jnp.ones((L, L), bool))
  q, k, v = _qkv(4, t=L, s=L)
  with pytest.raises(ValueError, match=r"mask_mod must be elementwise.*shape \(11, 11\).*"
                                       r"pass that array as `mask`"):
    flax_mha.dot_product_attention(q, k, v, mask_mod=lambda b, h, qi, kv: dense_TS,
                                   implementation=IMPLS_L.get(impl, impl))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(mask_mod=lambda b, h, q: q > 0), TypeError,
     r"mask_mod must take 4 positional arguments \(b, h, q_idx, kv_idx\) -> bool, got a "
     r"callable with signature \(b, h, q\)"),
    (dict(score_mod=lambda b, h, q, kv: q > kv), TypeError,
     r"score_mod must take 5 positional arguments \(score, b, h, q_idx, kv_idx\)"),
    (dict(mask_mod=lambda s, b, h, q, kv: q > kv), TypeError,
     "mask_mod must take 4 positional arguments"),
    (dict(score_mod=lambda s, b, h, q, kv: s[..., :1]), ValueError,
     r"score_mod failed when called with scalar arguments .* elementwise"),
    (dict(score_mod=lambda s, b, h, q, kv: jnp.stack([s, s])), ValueError,
     r"score_mod must be elementwise: .* got shape \(2,\)"),
])
def test_mods_of_the_wrong_shape_or_signature_are_named(kwargs, error, match):
  q, k, v = _qkv(5, t=L, s=L)
  with pytest.raises(error, match=match):
    flax_mha.dot_product_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("impl", sorted(IMPLS_L))
def test_window_wider_than_the_sequence_is_no_limit(impl):
  q, k, v = _qkv(6, t=L, s=L)
  fn = jax.jit(lambda q: flax_mha.dot_product_attention(
      q, k, v, local_window_size=(2**40, 0), implementation=IMPLS_L[impl]))
  np.testing.assert_allclose(fn(q), np_attention(q, k, v, is_causal=True), atol=2e-5,
                             rtol=2e-5)


FINITE_CASES = {
    "mask": lambda rng: dict(mask=jnp.asarray(rng.random((B, 1, L, L)) < 0.5).at[0, 0, 2]
                             .set(False)),
    "causal": lambda rng: dict(is_causal=True),
    "lengths": lambda rng: dict(query_seq_lengths=jnp.array([3, 11]),
                                key_value_seq_lengths=jnp.array([0, 11])),
    "segments_soft_cap": lambda rng: dict(q_segment_ids=jnp.asarray(DOCS), logit_soft_cap=3.0),
    "window_mask": lambda rng: dict(local_window_size=(2, 0),
                                    mask=jnp.asarray(rng.random((B, 1, L, L)) < 0.5)),
}


def _finite_kept(impl, case, dtype):
  """Out of the slow run: in float32 every case for the oracle and chunked, a mask (xla) or
  lengths (rows) hiding rows whole for the others; in float64 (its own finfo.min at stake)
  lengths for every implementation, mask and segments for chunked. Of the float64 ones the unit
  suite keeps chunked's lengths, the integration part the rest."""
  if dtype == np.float32:
    return impl in ("reference", "chunked") or (impl, case) in (("xla", "mask"),
                                                                ("rows", "lengths"))
  return case == "lengths" or (impl == "chunked" and case in ("mask", "segments_soft_cap"))


FINITE_GRID = split_grid(
    _finite_kept,
    lambda impl, case, dtype: dtype == np.float64 and (impl, case) != ("chunked", "lengths"),
    ["reference", "xla", "chunked", "rows"], sorted(FINITE_CASES), [np.float32, np.float64])


@pytest.mark.parametrize("impl,case,dtype", FINITE_GRID.unit)
def test_no_inf_or_nan_is_made_inside(impl, case, dtype):
  """With `jax.debug_infs`, op by op (no jit), forward and gradient: finite input, masks hiding
  whole rows, and no implementation writes an inf anywhere."""
  kwargs = FINITE_CASES[case](np.random.default_rng(7))
  if impl == "rows" and set(kwargs) - {"mask", "is_causal", "local_window_size"}:
    pytest.skip("rows takes bias, mask, is_causal and a window only")
  with jax.enable_x64(dtype == np.float64), jax.debug_infs(True):
    q, k, v = _qkv(8, t=L, s=L, dtype=dtype)
    loss = lambda q: jnp.sum(flax_mha.dot_product_attention(q, k, v, implementation=impl,
                                                            **kwargs) ** 2)
    value, grad = jax.value_and_grad(loss)(q)
  chex.assert_tree_all_finite((value, grad))
