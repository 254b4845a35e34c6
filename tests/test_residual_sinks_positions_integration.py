"""Attention sinks and the softmax statistics (`return_residual`) in every implementation, and
positions with windows: the cases tests/test_residual_sinks_positions.py leaves out (sinks
without causality, causality without sinks; slow: the other of sinks-with-causality and
neither, the other windows), through that file's own tests."""

from __future__ import annotations

import pytest

import test_residual_sinks_positions as unit


pytestmark = pytest.mark.integration  # a compile of values and one of gradients a case

# Cases of tests/test_residual_sinks_positions.py that compile for seconds: the unit part skips them
# (`check_` there), the integration part runs them here.
test_reference_sink_gradient_matches_finite_differences_in_float64 = (
    unit.check_reference_sink_gradient_matches_finite_differences_in_float64)


@pytest.mark.parametrize("impl,with_sinks,is_causal", [
    (impl, flag, not flag) for impl in sorted(unit.IMPLS) for flag in (False, True)])
def test_sinks_and_lse_match_numpy_values_and_gradients(impl, with_sinks, is_causal):
  unit.test_sinks_and_lse_match_numpy_values_and_gradients(impl, with_sinks, is_causal)


@pytest.mark.slow
@pytest.mark.parametrize("impl,with_sinks,is_causal", unit.OTHER_SINKS_CASES)
def test_sinks_and_lse_match_numpy_values_and_gradients_other_diagonal(impl, with_sinks,
                                                                       is_causal):
  unit.test_sinks_and_lse_match_numpy_values_and_gradients(impl, with_sinks, is_causal)


@pytest.mark.parametrize("impl,window", unit.POSITIONS_GRID.integration)
def test_positions_match_numpy(impl, window):
  unit.test_positions_match_numpy(impl, window)
