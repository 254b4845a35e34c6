"""The Hugging Face families' attention options (tests/nn/test_family_options.py) decoded
through every cache kind, and their gradients checked numerically in float64 (integration:
seconds of compiles per case).

Dimension key (flax_mha/__init__.py): B batch, L length, D width.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_params, randn
from test_family_options import B, D, L, shared_linen, decoded_equals_full

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("case, kind", [
    (case, kind) for case in ("all", "partial_interleaved", "yarn")
    for kind in ("full", "rolling", "paged") if (case, kind) != ("all", "paged")])  # unit's
def test_cached_decoding_equals_the_full_causal_call(rng, case, kind):
  decoded_equals_full(rng, case, kind)


@pytest.mark.parametrize("case", ["all", "rms_qk"])
def test_gradients_match_finite_differences(rng, case):
  """In float64: the parameters' and the input's gradients of the linen layer."""
  with jax.enable_x64(True):
    x = randn(rng, B, L, D, dtype=np.float64)
    model = shared_linen(case, param_dtype=jnp.float64)
    params = jax.tree.map(lambda a: a.astype(np.float64), random_params(model, x))
    loss = lambda p, x: jnp.sum(jnp.sin(model.apply(p, x, is_causal=True)))
    jax.test_util.check_grads(loss, (params, x), order=1, modes=["rev"], atol=1e-5, rtol=1e-5)


