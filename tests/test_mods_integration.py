"""flax_mha.mods at the cases tests/test_mods.py leaves out, each through that file's own test:
two more of torch's FlexAttention functions, the grids' cells for the integration part, and
(slow) the default chunked kernel, which at these lengths runs a single tile that the unit
part's small-block chunked covers, and the rest of each grid."""

from __future__ import annotations

import pytest

import test_mods as unit

pytestmark = pytest.mark.integration  # a compile of values and gradients a case: seconds each

CHUNKED = pytest.param("chunked", marks=pytest.mark.slow)


@pytest.mark.parametrize("impl", [CHUNKED])
@pytest.mark.parametrize("case", sorted(unit.OPTION_CASES))
def test_options_match_numpy_and_the_oracle_gradients(impl, case):
  unit.test_options_match_numpy_and_the_oracle_gradients(impl, case)


@pytest.mark.parametrize("impl", [CHUNKED])
@pytest.mark.parametrize("kwargs", unit.JAX_NN_OPTIONS.values(), ids=unit.JAX_NN_OPTIONS.keys())
def test_matches_jax_nn(impl, kwargs):
  unit.test_matches_jax_nn(impl, kwargs)


@pytest.mark.parametrize("case,impl", [
    *((case, impl) for case in unit.LATER_FLEX_CASES for impl in unit.impl_params(unit.IMPLS)),
    *(pytest.param(case, "chunked", marks=pytest.mark.slow)
      for case in unit.FLEX_CASES + unit.LATER_FLEX_CASES)])
def test_matches_torch_flex_attention(case, impl):
  unit.test_matches_torch_flex_attention(impl, case)


@pytest.mark.parametrize("impl", [CHUNKED])
def test_score_mod_arrays_get_gradients(impl):
  unit.test_score_mod_arrays_get_gradients(impl)


@pytest.mark.parametrize("impl,transform", unit.TRANSFORM_GRID.integration)
def test_mods_closing_over_traced_arrays_under_transforms_with_grad(impl, transform):
  unit.test_mods_closing_over_traced_arrays_under_transforms_with_grad(impl, transform)


@pytest.mark.parametrize("impl,mods", unit.SCORE_TERMS_GRID.integration)
def test_minus_inf_bias_stays_hidden_through_score_terms(impl, mods):
  unit.test_minus_inf_bias_stays_hidden_through_score_terms(impl, mods)


@pytest.mark.parametrize("impl,case,dtype", unit.FINITE_GRID.integration)
def test_no_inf_or_nan_is_made_inside(impl, case, dtype):
  unit.test_no_inf_or_nan_is_made_inside(impl, case, dtype)
