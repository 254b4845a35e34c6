"""The modern options of flax_mha.nn.linen at the cases the unit part, test_linen_options.py,
leaves out: soft cap and windows with one key/value head (MQA), and decoding two tokens a step
for the options whose cache does not move with the step's width (slow). Each runs the unit
part's own test."""

import pytest

import test_linen_options as unit

pytestmark = pytest.mark.integration  # one more compile per case (and the slow ones: many)


@pytest.mark.parametrize("g", [1])
@pytest.mark.parametrize("cap,window,is_causal", unit.SOFT_CAP_AND_WINDOW)
def test_soft_cap_and_window(rng, variant, g, cap, window, is_causal):
  unit.test_soft_cap_and_window(rng, variant, g, cap, window, is_causal)


@pytest.mark.slow
@pytest.mark.parametrize("case,chunk", [(case, 2) for case in sorted(unit.DECODE_CASES)
                                        if case not in unit.TWO_A_STEP])
def test_decode_equals_full_causal(rng, case, chunk):
  unit.test_decode_equals_full_causal(rng, case, chunk)
