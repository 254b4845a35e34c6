"""flax_mha.parallel.ring at the cases tests/parallel/test_ring.py leaves out: 4 sequence shards
equal single-device attention on 8 emulated devices, values and grads, each check in a subprocess
(tests/multidevice/check_ring.py, check_ring_blocks.py, check_seq_parallel.py); the ring and the
strategies compiled on one-device meshes against the oracle; and the auto strategy's rule on a
band over 32768 keys.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import flax_mha
from flax_mha import mods as mods_lib
from flax_mha.parallel import sharding
from flax_mha import ring_implementation
from flax_mha.parallel.seq_parallel import ring_attention
from helpers import np_attention, output_and_grads, qkv
from tests.multidevice.run import run_check
import test_ring as unit

pytestmark = pytest.mark.integration  # subprocesses on 8 devices; shard_map compiles


@pytest.mark.multidevice
def test_ring_matches_single_device_on_8_devices():
  lines = run_check("check_ring.py")
  assert [line.split()[1] for line in lines] == [
      "full", "gqa_causal", "mqa_full",
      "mesh_Auto", "abstract_mesh_Auto", "mesh_Explicit", "abstract_mesh_Explicit",
      "mesh_mixed", "abstract_mesh_mixed", "explicit_query_type_kept",
      "key_padding_causal", "full_mask", "sinks_residual", "sends", "export_cuda_tpu"]


@pytest.mark.multidevice
def test_ring_steps_with_the_accelerator_kernel_on_8_devices():
  """The Triton kernel (interpreted) as the ring's step kernel equals one device, and an export
  for 'cuda' steps with it inside stage_accelerator_kernels()."""
  names = [line.split()[1] for line in run_check("check_ring_blocks.py")]
  assert len(names) == 10 and names[-2:] == ["mask_mod_falls_back", "export_cuda_triton_steps"]


@pytest.mark.multidevice
def test_every_strategy_and_layout_matches_single_device_on_8_devices():
  names = [line.split()[1] for line in run_check("check_seq_parallel.py")]
  pairs = {tuple(name.split("/")[1:]) for name in names}
  # 3 strategies x 3 layouts, in_layout 2, keyword options 3
  assert len(pairs) == 9 and len(names) == 21, names


@pytest.mark.parametrize("is_causal", [False, True])
def test_one_device_ring_is_plain_attention(rng, is_causal):
  q, k, v = qkv(rng)
  out = ring_attention(q, k, v, mesh=sharding.make_mesh(), is_causal=is_causal)
  np.testing.assert_allclose(out, np_attention(q, k, v, is_causal=is_causal), atol=1e-5)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_keyword_options_as_in_dot_product_attention(rng, strategy):
  """The strategies take dot_product_attention's keyword options (built into mods the same
  way) and compute what it computes with them; with mods= too, or an unknown one, an error."""
  q, k, v = qkv(rng, t=7, s=7)
  ids = jnp.asarray(np.cumsum(rng.random((q.shape[0], 7)) < 0.3, axis=1), jnp.int32)
  pos = jnp.asarray(np.arange(7) * 2)[None]
  options = dict(is_causal=True, q_segment_ids=ids, q_positions=pos, kv_positions=pos,
                 local_window_size=(5, 0), logit_soft_cap=3.0, query_seq_lengths=jnp.array([6, 7]))
  mesh = sharding.make_mesh()
  out = flax_mha.sequence_parallel_attention(q, k, v, mesh=mesh, strategy=strategy, **options)
  want = flax_mha.dot_product_attention(q, k, v, implementation="reference", **options)
  np.testing.assert_allclose(out, want, atol=1e-5)
  with pytest.raises(ValueError, match=r"pass mods or the keyword options \['logit_soft_cap'\]"):
    ring_attention(q, k, v, mesh=mesh, mods=mods_lib.Mods(), logit_soft_cap=3.0)
  with pytest.raises(TypeError, match=r"unexpected keyword arguments \['q_segment'\]"):
    ring_attention(q, k, v, mesh=mesh, q_segment=ids)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_one_device_mesh_of_either_axis_type(rng, axis_type):
  """Regression: `jax.make_mesh` meshes are Explicit by default, and shard_map rejected them."""
  q, k, v = qkv(rng)
  n = len(sharding.MESH_AXES)
  mesh = jax.make_mesh((1,) * n, sharding.MESH_AXES, axis_types=(axis_type,) * n)
  want = np_attention(q, k, v, is_causal=True)
  call = lambda m: (lambda q, k, v: ring_attention(q, k, v, mesh=m(), is_causal=True,
                                                   batch_axis="data", head_axis="model"))
  np.testing.assert_allclose(call(lambda: mesh)(q, k, v), want, atol=1e-5)
  with jax.set_mesh(mesh):
    np.testing.assert_allclose(jax.jit(call(lambda: mesh))(q, k, v), want, atol=1e-5)
    abstract = jax.jit(call(jax.sharding.get_abstract_mesh))(q, k, v)
  np.testing.assert_allclose(abstract, want, atol=1e-5)


def test_ring_implementation_on_a_one_device_mesh(rng):
  """Needs the core's `implementation=<callable>` (flax_mha.attention)."""
  q, k, v = qkv(rng)
  mask = jnp.asarray(rng.random((2, 1, 5, 7)) < 0.6)
  with jax.set_mesh(sharding.make_mesh()):
    out = flax_mha.dot_product_attention(q, k, v, mask=mask, implementation=ring_implementation)
  np.testing.assert_allclose(out, np_attention(q, k, v, mask=mask), atol=1e-5)


def test_ring_callable_without_the_dispatcher(rng):
  """The callable itself, as the dispatcher calls it (rank-4 mask); runs before the core change."""
  q, k, v = qkv(rng)
  mask = jnp.asarray(rng.random((2, 1, 5, 7)) < 0.6)
  with jax.set_mesh(sharding.make_mesh()):
    out = ring_implementation(q, k, v, None, mask, is_causal=True, scale=0.5, dropout_rate=0.0,
                             dropout_rng=None)
  np.testing.assert_allclose(out, np_attention(q, k, v, mask=mask, is_causal=True, scale=0.5),
                             atol=1e-5)


@pytest.mark.parametrize("kwargs", [
    dict(local_window_size=(3, 1)), dict(logit_soft_cap=2.0, is_causal=True),
    dict(mask_mod=lambda b, h, q, kv: (q - kv) % 3 == 0),
    dict(score_mod=lambda s, b, h, q, kv: s - 0.1 * jnp.abs(q - kv))],
    ids=["window", "soft_cap", "mask_mod", "score_mod"])
def test_ring_takes_index_only_mods(rng, kwargs):
  q, k, v = qkv(rng, t=8, s=8)
  attend = lambda impl: lambda q: flax_mha.dot_product_attention(q, k, v, implementation=impl,
                                                                 **kwargs)
  want, (want_grad,) = output_and_grads(attend("reference"), q, jit=False)
  with jax.set_mesh(sharding.make_mesh()):
    out, (got_grad,) = output_and_grads(attend(ring_implementation), q)  # one compile
  np.testing.assert_allclose(out, want, atol=1e-5)
  np.testing.assert_allclose(got_grad, want_grad, atol=1e-5)


def test_ring_takes_segment_ids_and_lengths(rng):
  """Terms holding arrays: the key side's travel with their shard."""
  q, k, v = qkv(rng, t=8, s=8)
  options = dict(is_causal=True, q_segment_ids=jnp.array([[0, 0, 1, 1, 1, 2, 2, 2]] * 2),
                 key_value_seq_lengths=jnp.array([8, 6]))
  want = flax_mha.dot_product_attention(q, k, v, implementation="reference", **options)
  with jax.set_mesh(sharding.make_mesh()):
    out = flax_mha.dot_product_attention(q, k, v, implementation=ring_implementation, **options)
  np.testing.assert_allclose(out, want, atol=1e-5)


@pytest.mark.parametrize("shapes, heads, extra, want, why",
                         [unit.AUTO_CASES[i] for i in unit.AUTO_LATER],
                         ids=[unit.AUTO_IDS[i] for i in unit.AUTO_LATER])
def test_auto_strategy_rule(shapes, heads, extra, want, why):
  unit.test_auto_strategy_rule(shapes, heads, extra, want, why)
