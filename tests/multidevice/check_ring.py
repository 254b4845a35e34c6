"""Run under XLA_FLAGS=--xla_force_host_platform_device_count=8
(tests/parallel/test_ring_integration.py does).

Ring attention over 4 sequence shards (x 2 batch shards) must equal the float64 NumPy attention
of tests/helpers.py in values and single-device `flax_mha.kernels.reference` in loss and gradients:
causal and not, MHA, GQA and MQA, T != S, V != K, on meshes with Auto, Explicit and mixed axes,
and as the `implementation` callable of `flax_mha.dot_product_attention`; that the compiled
program receives n - 1 key/value shards forward and n + n (K/V, dK/dV) backward; and that
forward+backward lowers for 'cuda' and 'tpu' (`jax.export`, lowering only) from this CPU mesh.
Prints one 'OK ...' per check.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_mha
from experiments.bench import hlo_bytes
from flax_mha.parallel import sharding
from flax_mha.kernels import reference
from flax_mha import ring_implementation
from flax_mha.parallel.seq_parallel import ring_attention
from tests.helpers import np_attention

B, H, K, V = 2, 6, 5, 7  # distinct sizes so a swapped axis fails

CASES = (  # (name, T, S, G, is_causal); T and S multiples of the 4 sequence shards
    ("full", 12, 20, H, False),
    ("gqa_causal", 12, 16, 3, True),
    ("mqa_full", 8, 12, 1, False),
)


def loss_and_output(attention):
  """jit: (q, k, v) -> ((loss, output), (dq, dk, dv)); one compile checks values and grads."""
  def fn(q, k, v):
    out = attention(q, k, v)
    return jnp.sum(jnp.sin(out) * jnp.arange(V)), out
  return jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2), has_aux=True))


def single_device(is_causal, mask=None):
  return lambda q, k, v: reference.attention(q, k, v, None, mask, is_causal=is_causal,
                                             scale=K**-0.5, dropout_rate=0.0, dropout_rng=None)


def expected(q, k, v, *, is_causal, mask=None):
  """(float64 NumPy output, single-device reference loss, reference grads)."""
  (want_l, _), want_g = loss_and_output(single_device(is_causal, mask))(q, k, v)
  return np_attention(q, k, v, mask=mask, is_causal=is_causal), want_l, want_g


def random_qkv(rng, t, s, g):
  """query [B, t, H, K], key [B, s, g, K], value [B, s, g, V], float32."""
  return tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32)
               for shape in ((B, t, H, K), (B, s, g, K), (B, s, g, V)))


def check(name, ring, args, want, *eager_outs):
  """`ring(*args)` under jit (and any `eager_outs`) against `want` = expected(...); returns the
  jitted output."""
  (got_l, out), got_g = loss_and_output(ring)(*args)
  want_out, want_l, want_g = want
  for got in (out, *eager_outs):
    np.testing.assert_allclose(got, want_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_l, want_l, rtol=1e-5, atol=1e-4)
  for x, a, b in zip("qkv", got_g, want_g):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"d{x}")
  print(f"OK {name} max|out - float64|={float(np.abs(out - want_out).max()):.1e}")
  return out


def check_cases(rng):
  mesh = sharding.make_mesh(data=2, seq=4)
  for name, t, s, g, is_causal in CASES:
    q, k, v = random_qkv(rng, t, s, g)
    ring = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, is_causal=is_causal,
                                          batch_axis="data")
    out = check(name, ring, (q, k, v), expected(q, k, v, is_causal=is_causal))
    assert out.sharding.spec == P("data", "seq"), out.sharding.spec
    assert out.addressable_shards[0].data.shape == (B // 2, t // 4, H, V)


def check_mesh_kinds(rng):
  """Regression: a `jax.make_mesh` mesh (Explicit axes by default) failed inside shard_map with a
  spec mismatch. Each kind runs eagerly, under jit without a context mesh, and through the
  abstract mesh of jax.set_mesh."""
  q, k, v = random_qkv(rng, 8, 12, 3)
  want = expected(q, k, v, is_causal=True)
  assert jax.make_mesh((2, 4), ("data", "seq")).axis_types == (AxisType.Explicit,) * 2
  kinds = {"Auto": (AxisType.Auto,) * 2, "Explicit": (AxisType.Explicit,) * 2,
           "mixed": (AxisType.Auto, AxisType.Explicit)}
  on = lambda get_mesh: lambda q, k, v: ring_attention(q, k, v, mesh=get_mesh(), is_causal=True,
                                                       batch_axis="data")
  for name, axis_types in kinds.items():
    mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=axis_types)
    out = check(f"mesh_{name}", on(lambda: mesh), (q, k, v), want, on(lambda: mesh)(q, k, v))
    # The output has the query's type (Explicit axes only ever appear in types): replicated.
    assert jax.typeof(out).sharding.spec == P(None, None, None, None), jax.typeof(out)
    with jax.set_mesh(mesh):
      check(f"abstract_mesh_{name}", on(jax.sharding.get_abstract_mesh), (q, k, v), want)
  # A query already laid out ring-wise keeps that layout in its type.
  mesh = jax.make_mesh((2, 4), ("data", "seq"))
  laid = [jax.reshard(x, NamedSharding(mesh, P("data", "seq"))) for x in (q, k, v)]
  out = check("explicit_query_type_kept", on(lambda: mesh), laid, want)
  assert jax.typeof(out).sharding.spec == P("data", "seq", None, None), jax.typeof(out)
  assert out.addressable_shards[0].data.shape == (B // 2, 8 // 4, H, V)


def check_masked_via_dot_product_attention(rng):
  """The ring callable as `implementation` under jax.set_mesh on data x model x seq = 2 x 2 x 2,
  with masks (needs the core's `implementation=<callable>`)."""
  t, s = 8, 12
  q, k, v = random_qkv(rng, t, s, 2)
  key_padding = (jnp.arange(s) < jnp.array([s, 5])[:, None])[:, None, None, :]  # [B, 1, 1, S]
  full = key_padding & jnp.asarray(rng.random((B, 1, t, s)) < 0.7)
  full = full.at[1, :, 3].set(False)  # a query row with no visible key: output 0
  mesh = sharding.make_mesh(data=2, model=2, seq=2)
  for name, mask, is_causal in (("key_padding_causal", key_padding, True),
                                ("full_mask", full, False)):
    ring = lambda q, k, v: flax_mha.dot_product_attention(
        q, k, v, mask=mask, is_causal=is_causal, implementation=ring_implementation)
    want = expected(q, k, v, mask=mask, is_causal=is_causal)
    with jax.set_mesh(mesh):
      out = check(name, ring, (q, k, v), want)
    assert out.sharding.spec == P("data", "seq", "model"), out.sharding


def check_sinks_and_residual(rng):
  """Learned sinks (their gradient summed over the sequence and batch shards that share them)
  and the residual (lse) of ring attention on data x seq = 2 x 4 equal the single device's."""
  t, s = 8, 12
  q, k, v = random_qkv(rng, t, s, 3)
  sinks = jnp.asarray(rng.standard_normal(H), jnp.float32)
  mesh = sharding.make_mesh(data=2, seq=4)

  def run(implementation):
    def loss(q, k, v, sinks):
      out, lse = flax_mha.dot_product_attention(q, k, v, is_causal=True, sinks=sinks,
                                                return_residual=True,
                                                implementation=implementation)
      return jnp.sum(jnp.sin(out) * jnp.arange(V)), (out, lse)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)

  (want_loss, (want_out, want_lse)), want_grads = run("reference")
  with jax.set_mesh(mesh):
    (loss, (out, lse)), grads = run(ring_implementation)
  np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(lse, want_lse, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(loss, want_loss, atol=1e-4, rtol=1e-5)
  for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads):
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4, err_msg=name)
  print(f"OK sinks_residual loss={float(loss):.6f}")


def check_sends():
  """The compiled programs (XLA's own count, loops by their trip counts): each device receives
  n - 1 key/value shards forward, and backward n again (the last hop home, unused) plus n of
  dK/dV (home)."""
  n, t = 4, 16
  mesh = sharding.make_mesh(data=2, seq=n)
  split = NamedSharding(mesh, P("data", "seq"))
  q, k, v = (jax.ShapeDtypeStruct(shape, jnp.float32, sharding=split)
             for shape in ((B, t, H, K), (B, t, 3, K), (B, t, 3, V)))
  ring = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, is_causal=True, batch_axis="data")
  grads = jax.grad(lambda q, k, v: jnp.sum(ring(q, k, v)), argnums=(0, 1, 2))
  shard = (B // 2) * (t // n) * 3 * (K + V) * 4  # bytes of one K and V shard
  received = [hlo_bytes.collective_bytes(jax.jit(fn).lower(q, k, v).compile().as_text(), n)
              for fn in (ring, grads)]
  assert received == [(n - 1) * shard, (3 * n - 1) * shard], (received, shard)
  print(f"OK sends forward={received[0] / shard:g} forward_backward={received[1] / shard:g} "
        "shards")


def check_export():
  """Forward+backward of ring attention with a window and a soft cap, exported for GPU and TPU
  on the 8-device mesh: lowering only, one ring of collective permutes in it."""
  x = jax.ShapeDtypeStruct((B, 16, H, K), jnp.float32)
  def loss(q, k, v):
    out = flax_mha.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=(4, 0), logit_soft_cap=20.0,
        implementation=ring_implementation)
    return jnp.sum(out * out)
  with jax.set_mesh(sharding.make_mesh(data=2, seq=4)):
    exported = jax.export.export(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))),
                                 platforms=("cuda", "tpu"))(x, x, x)
  assert exported.platforms == ("cuda", "tpu") and exported.nr_devices == 8
  assert "collective_permute" in exported.mlir_module()
  print("OK export_cuda_tpu")


def main():
  assert jax.device_count() == 8, jax.device_count()
  rng = np.random.default_rng(0)
  check_cases(rng)
  check_mesh_kinds(rng)
  check_masked_via_dot_product_attention(rng)
  check_sinks_and_residual(rng)
  check_sends()
  check_export()


if __name__ == "__main__":
  main()
