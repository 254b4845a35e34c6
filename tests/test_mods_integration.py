"""flax_mha.mods at the cases tests/test_mods.py leaves out, each through that file's own test:
two more of torch's FlexAttention functions, the grids' cells for the integration part, and
(slow) the default chunked kernel, which at these lengths runs a single tile that the unit
part's small-block chunked covers, the implementation each case of the unit part's grids
leaves out in turn, and the rest of each grid."""

from __future__ import annotations

import pytest

import test_mods as unit

pytestmark = pytest.mark.integration  # a compile of values and gradients a case: seconds each

CHUNKED = pytest.param("chunked", marks=pytest.mark.slow)


@pytest.mark.slow
@pytest.mark.parametrize("impl,case", unit.later_cases(sorted(unit.OPTION_CASES)))
def test_options_match_numpy_and_the_oracle_gradients(impl, case):
  unit.test_options_match_numpy_and_the_oracle_gradients(impl, case)


@pytest.mark.slow
@pytest.mark.parametrize("impl,case", unit.later_cases(list(unit.JAX_NN_OPTIONS)))
def test_matches_jax_nn(impl, case):
  unit.test_matches_jax_nn(impl, case)


@pytest.mark.parametrize("impl,case", [
    *((impl, case) for case in unit.LATER_FLEX_CASES for impl in unit.impl_params(unit.IMPLS)),
    *(pytest.param(impl, case, marks=pytest.mark.slow)
      for impl, case in unit.later_cases(unit.FLEX_CASES + unit.LATER_FLEX_CASES)
      if case in unit.FLEX_CASES or impl == "chunked")])
def test_matches_torch_flex_attention(impl, case):
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
