"""The cases of tests/test_precision.py that compile for seconds: the unit part skips them
(`check_` there), the integration part runs them here."""

import pytest

import test_precision as unit_cases
from test_precision import lm  # noqa: F401  (the module's model, a fixture)

pytestmark = pytest.mark.integration

test_nnx_and_the_transformer_hand_xla_no_bf16_result_dot = (
    unit_cases.check_nnx_and_the_transformer_hand_xla_no_bf16_result_dot)
test_a_bf16_mixture_of_experts_hands_xla_float32_results_and_a_loop_no_weight = (
    unit_cases.check_a_bf16_mixture_of_experts_hands_xla_float32_results_and_a_loop_no_weight)
test_linen_and_nnx_agree_in_bf16_and_bf16_is_close_to_float32 = (
    unit_cases.check_linen_and_nnx_agree_in_bf16_and_bf16_is_close_to_float32)
test_a_batch_1_cpu_loop_converts_no_weight_and_keeps_the_tokens = (
    unit_cases.check_a_batch_1_cpu_loop_converts_no_weight_and_keeps_the_tokens)
test_jit_grad_vmap_and_scan_through_bf16_products = (
    unit_cases.check_jit_grad_vmap_and_scan_through_bf16_products)
