"""Run under XLA_FLAGS=--xla_force_host_platform_device_count=8
(tests/parallel/test_ring_integration.py does).

Every sequence-parallel strategy x layout on data x seq = 2 x 4 devices must equal single-device
`flax_mha.dot_product_attention` (the reference implementation) in output, loss and gradients to
1e-5: causal GQA with packed documents (segment ids), a causal window with soft-capping, key
lengths with a mask_mod over arrays, a score_mod over a table; and with the tokens given in the
layout's order (tokens="in_layout"); and sequence_parallel_attention given the keyword
options themselves.
Prints one 'OK ...' per check.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import flax_mha
from flax_mha.parallel import sharding
from flax_mha.parallel import layouts, seq_parallel

B, T, H, G, K, V = 2, 16, 8, 4, 5, 3  # Ulysses splits H and G over the 4 sequence devices
STRATEGIES = ("ring", "all_gather", "ulysses")


def segment_ids(rng):
  """[B, T] packed documents of random lengths."""
  ids = np.cumsum(rng.random((B, T)) < 0.2, axis=1)
  return jnp.asarray(ids, jnp.int32)


def cases(rng):
  """(name, options of dot_product_attention, the (strategy, layout) pairs to run, key/value
  heads): every pair for the first case, each strategy once (layouts in turn) for the rest."""
  every = [(s, layout) for s in STRATEGIES for layout in layouts.LAYOUTS]
  turn = lambda strategies, start: [(s, layouts.LAYOUTS[(start + i) % 3])
                                    for i, s in enumerate(strategies)]
  ids = segment_ids(rng)
  table = jnp.asarray(rng.standard_normal(2 * T), jnp.float32)
  return (
      ("causal_gqa_segments", dict(is_causal=True, q_segment_ids=ids), every, G),
      ("causal_window", dict(is_causal=True, local_window_size=(3, 0), logit_soft_cap=5.0),
       turn(STRATEGIES, 1), G),
      ("lengths_mask_mod", dict(key_value_seq_lengths=jnp.array([T, 9]),
                                mask_mod=lambda b, h, q, kv: ids[b, q] >= ids[b, kv]),
       turn(STRATEGIES, 2), G),
      ("score_mod_table", dict(is_causal=True,
                               score_mod=lambda s, b, h, q, kv: s + table[q - kv + T]),
       turn(("all_gather",), 2), 1),  # MQA
  )


def loss_and_grads(options, implementation, q, k, v):
  return grads_of(functools.partial(flax_mha.dot_product_attention,
                                    implementation=implementation, **options), q, k, v)


def grads_of(attend, q, k, v):
  """((loss, attend(q, k, v)), the loss's gradients in q, k, v), jitted."""
  def loss(q, k, v):
    out = attend(q, k, v)
    return jnp.sum(jnp.sin(out) * jnp.arange(V)), out
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)


def check(name, got, want):
  (got_l, got_out), got_g = got
  (want_l, want_out), want_g = want
  np.testing.assert_allclose(got_out, want_out, atol=1e-5, rtol=1e-5, err_msg=name)
  np.testing.assert_allclose(got_l, want_l, atol=1e-5, rtol=1e-5, err_msg=name)
  for x, a, b in zip("qkv", got_g, want_g):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4, err_msg=f"{name} d{x}")
  print(f"OK {name} max|out - reference|={float(np.abs(got_out - want_out).max()):.1e}")


def check_strategies_and_layouts(rng):
  mesh = sharding.make_mesh(data=2, seq=4)
  for name, options, pairs, g in cases(rng):
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
               for shape in ((B, T, H, K), (B, T, g, K), (B, T, g, V)))
    want = loss_and_grads(options, "reference", q, k, v)
    for strategy, layout in pairs:
      impl = flax_mha.sequence_parallel_implementation(strategy, layout)
      with jax.set_mesh(mesh):
        got = loss_and_grads(options, impl, q, k, v)
      check(f"{name}/{strategy}/{layout}", got, want)


def check_tokens_in_layout(rng):
  """tokens="in_layout": inputs (and segment ids) permuted to the layout once by the caller,
  the output in that order; undone, it is the single-device output."""
  mesh = sharding.make_mesh(data=2, seq=4)
  ids = segment_ids(rng)
  q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
             for shape in ((B, T, H, K), (B, T, G, K), (B, T, G, V)))
  want = loss_and_grads(dict(is_causal=True, q_segment_ids=ids), "reference", q, k, v)
  for strategy, layout in (("ring", "zigzag"), ("all_gather", "striped")):
    impl = flax_mha.sequence_parallel_implementation(strategy, layout, "in_layout")
    to, back = (functools.partial(f, layout=layout, n=4) for f in (
        seq_parallel.to_layout_order, seq_parallel.from_layout_order))
    options = dict(is_causal=True, q_segment_ids=to(ids))
    with jax.set_mesh(mesh):
      (loss, out), grads = loss_and_grads(options, impl, to(q), to(k), to(v))
    check(f"in_layout/{strategy}/{layout}", ((loss, back(out)), [back(g) for g in grads]), want)


def check_keyword_options(rng):
  """sequence_parallel_attention itself, given dot_product_attention's keyword options rather
  than prebuilt mods, equals the single-device call with them, every strategy."""
  mesh = sharding.make_mesh(data=2, seq=4)
  options = dict(is_causal=True, q_segment_ids=segment_ids(rng), local_window_size=(5, 0),
                 logit_soft_cap=5.0)
  q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
             for shape in ((B, T, H, K), (B, T, G, K), (B, T, G, V)))
  want = loss_and_grads(options, "reference", q, k, v)
  for strategy, layout in zip(STRATEGIES, layouts.LAYOUTS):
    attend = functools.partial(flax_mha.sequence_parallel_attention, mesh=mesh,
                               strategy=strategy, layout=layout, batch_axis="data", **options)
    check(f"keywords/{strategy}/{layout}", grads_of(attend, q, k, v), want)


def main():
  assert jax.device_count() == 8, jax.device_count()
  rng = np.random.default_rng(0)
  check_strategies_and_layouts(rng)
  check_tokens_in_layout(rng)
  check_keyword_options(rng)


if __name__ == "__main__":
  main()
