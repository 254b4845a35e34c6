"""A compiled Pallas kernel named on this CPU (tests/test_export.py's part that lowers for two
platforms at once): refused by name while tracing, and while lowering through None inside
stage_accelerator_kernels()."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import flax_mha
import test_export as unit

pytestmark = pytest.mark.integration  # lowering forward+backward for two platforms: ~5 s a case


@pytest.mark.parametrize("name, platform", [("splash", "tpu"), ("triton", "cuda")])
def test_an_accelerator_kernel_is_refused_by_name_here(name, platform):
  """Named on this CPU, a compiled Pallas kernel is refused while tracing with the ways to run
  it (interpreted) or export it; exported for several platforms at once with a CPU among them,
  through None inside stage_accelerator_kernels(), it is refused while lowering, forward and
  backward alike, never with Pallas's own "Only interpret mode" error."""
  q, k, v = (jnp.ones(s.shape) for s in unit.shapes(64))
  with pytest.raises(ValueError, match=(
      rf"implementation '{name}' is a '{platform}' kernel and this process has no "
      rf"'{platform}' device .*make_attention\(interpret=True\).*stage_accelerator_kernels")):
    flax_mha.dot_product_attention(q, k, v, implementation=name)
  for fn in (jax.jit(lambda q, k, v: flax_mha.dot_product_attention(q, k, v, is_causal=True)),
             unit.fwd_bwd(None, is_causal=True)):
    with flax_mha.stage_accelerator_kernels(), pytest.raises(ValueError, match=(
        rf"implementation '{name}' is a '{platform}' kernel and cannot be lowered for 'cpu'"
        rf".* platforms=\('{platform}',\)")):
      unit.export(fn, ("cpu", platform), 64)


# Moved from the unit part for its time (4 s).
test_the_decode_kernel_is_refused_by_name_here = unit.check_the_decode_kernel_is_refused_by_name_here
