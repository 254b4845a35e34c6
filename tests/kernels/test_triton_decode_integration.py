"""The Triton decode kernel in Pallas interpret mode at the cases
tests/kernels/test_triton_decode.py leaves out: the cache's step for MQA, several tokens, a
window with a soft cap, a rolling cache with sink tokens and sinks; paged_attention with reused
pages holding NaN past each length, under vmap, a scan over layers and jax.checkpoint; bfloat16
pages. Each against the XLA step, values and gradients."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import pytest

import flax_mha
from flax_mha import call_options
from flax_mha.kernels import decode
from flax_mha.kernels import triton_decode
from helpers import output_and_grads
import test_triton_decode as unit
from test_triton_decode import B, H, K


pytestmark = pytest.mark.integration  # the kernel compiled in interpret mode: ~2-4 s a case

# Cases of tests/kernels/test_triton_decode.py that compile for seconds: the unit part skips them
# (`check_` there), the integration part runs them here.
test_cache_step_equals_the_xla_step_gqa = (
    unit.check_cache_step_equals_the_xla_step_gqa)


@pytest.mark.parametrize("name", [n for n in unit.CACHE_CASES if n != "gqa_one_token"])
def test_cache_step_equals_the_xla_step(name):
  unit.check_cache_step(name)


@pytest.mark.parametrize("options", [{}, dict(local_window_size=(20, 0), logit_soft_cap=3.0,
                                              sinks=jnp.asarray([0.5, -1.0, 2.0, 0.0]))],
                         ids=["plain", "window_soft_cap_sinks"])
def test_paged_attention_equals_the_xla_decode(options):
  """Through paged_attention: pages read in place by the table, NaN past each length unseen."""
  q, k_pages, v_pages, lengths, table = unit.paged_case()
  fn = lambda impl: lambda q, k, v: flax_mha.paged_attention(q, k, v, lengths, table,
                                                             implementation=impl, **options)
  got = output_and_grads(fn(unit.INTERPRETED), q, k_pages, v_pages)
  want = output_and_grads(fn(None), q, k_pages, v_pages)
  assert bool(jnp.isfinite(got[0]).all())
  chex.assert_trees_all_close(got, want, atol=2e-6, rtol=2e-6)


def _over_layers(fn):
  """fn(q, k_pages, v_pages) summed over layers: a lax.scan over stacked [layers, ...] pools."""
  def layers(q, k_layers, v_layers):
    step = lambda total, kv: (total + fn(q, *kv), None)
    zeros = jnp.zeros(q.shape[:-1] + (v_layers.shape[-1],), q.dtype)
    return jax.lax.scan(step, zeros, (k_layers, v_layers))[0]
  return layers


# name -> (transform of fn(q, k_pages, v_pages), how its arguments are built from one case's)
PAGED_TRANSFORMS = {
    "vmap": (lambda f: jax.vmap(f, in_axes=(0, None, None)),
             lambda q, k, v: (jnp.stack([q, -q]), k, v)),
    "scan_over_layers": (_over_layers,
                         lambda q, k, v: (q, jnp.stack([k, 0.5 * k]), jnp.stack([v, 2.0 * v]))),
    "checkpoint": (jax.checkpoint, lambda q, k, v: (q, k, v)),
}


@pytest.mark.parametrize("transform", sorted(PAGED_TRANSFORMS))
def test_paged_attention_under_transforms(transform):
  """The kernel under vmap (two queries over one pool), a scan over layers (a pool per layer)
  and jax.checkpoint, jitted with gradients: as the XLA decode under the same transform."""
  q, k_pages, v_pages, lengths, table = unit.paged_case()
  wrap, arguments = PAGED_TRANSFORMS[transform]
  fn = lambda impl: wrap(lambda q, k, v: flax_mha.paged_attention(
      q, k, v, lengths, table, local_window_size=(20, 0), implementation=impl))
  args = arguments(q, k_pages, v_pages)
  got = output_and_grads(fn(unit.INTERPRETED), *args)
  want = output_and_grads(fn(None), *args)
  assert bool(jnp.isfinite(got[0]).all())
  chex.assert_trees_all_close(got, want, atol=2e-6, rtol=2e-6)


def test_bfloat16_pages():
  q, k_pages, v_pages, lengths, table = unit.paged_case(dtype=jnp.bfloat16, t=1)
  v_pages = jnp.nan_to_num(v_pages)
  mods, _ = call_options.build((B,), 1, 48, H, q.dtype, True,
                                    q_positions=lengths[:, None] - 1,
                                    kv_positions=jnp.where(jnp.arange(48) < lengths[:, None],
                                                           jnp.arange(48), -1))
  cfg, cfg_bwd = decode.configs(0.25, 0.0, 1, 48, K, 16)
  got, _ = triton_decode.paged_attention(q, k_pages, v_pages, table, lengths, mods, cfg, cfg_bwd,
                                         interpret=True)
  want, _ = decode.paged(q, k_pages, v_pages, table, lengths, mods, cfg, cfg_bwd, 2)
  assert got.dtype == jnp.bfloat16
  chex.assert_trees_all_close(got.astype(jnp.float32), want.astype(jnp.float32), atol=3e-2)
