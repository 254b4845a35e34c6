"""Every implementation against the oracle at the cases tests/kernels/test_implementations.py
leaves out, each through that file's own test: rows hidden by a -inf bias at 600² (where None
picks "rows"), float64 without causality, and (slow) the option combinations outside the unit
file's covering array, the empty dims and causal float64 it gives other implementations."""

from __future__ import annotations

import pytest

import test_implementations as unit

import test_xla as test_xla_cases

pytestmark = pytest.mark.integration  # 600² rows, float64 programs: seconds a case

# Cases of tests/kernels/test_xla.py that compile for seconds: the unit part skips them
# (`check_` there), the integration part runs them here.
test_masked_softmax_equals_softmax_of_visible_entries_and_zeroes_hidden_rows = (
    test_xla_cases.check_masked_softmax_equals_softmax_of_visible_entries_and_zeroes_hidden_rows)


@pytest.mark.slow
@pytest.mark.parametrize("name,use_bias,use_mask,is_causal,dropout_rate,heads",
                         unit.SLOW_ORACLE_CASES)
def test_values_and_grads_match_oracle(name, use_bias, use_mask, is_causal, dropout_rate, heads):
  unit.test_values_and_grads_match_oracle(name, use_bias, use_mask, is_causal, dropout_rate,
                                          heads)


@pytest.mark.parametrize("implementation", [None, *unit.SINGLE_DEVICE])
@pytest.mark.parametrize("n", [600])  # None: "rows" at 600²
def test_rows_hidden_by_minus_inf_bias_give_zero_and_finite_grads(implementation, n):
  unit.test_rows_hidden_by_minus_inf_bias_give_zero_and_finite_grads(implementation, n)


@pytest.mark.parametrize("implementation,is_causal", [
    *((implementation, False) for implementation in unit.SINGLE_DEVICE),
    *(pytest.param(implementation, True, marks=pytest.mark.slow)
      for implementation in unit.SINGLE_DEVICE if implementation not in unit.FLOAT64_CAUSAL)])
def test_float64_in_float64_accuracy_out(implementation, is_causal):
  unit.test_float64_in_float64_accuracy_out(implementation, is_causal)


@pytest.mark.parametrize("implementation,dims", unit.EMPTY_GRID.integration)
def test_empty_dims(implementation, dims):
  unit.test_empty_dims(implementation, dims)
