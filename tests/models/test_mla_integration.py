"""The latent caches' cases of tests/models/test_mla.py that compile for seconds: the unit part
keeps the full cache's (`check_` there), the integration part runs the paged and int8
caches' here."""

import pytest

import test_mla as unit_cases
from test_mla import params  # noqa: F401  (the moved case's fixture)

pytestmark = pytest.mark.integration  # seconds of compiles a case


@pytest.mark.parametrize("kind", ["paged", "int8"])
def test_a_long_prefill_expands_each_latent_cache_as_the_forward(params, kind):  # noqa: F811
  unit_cases.check_a_long_prefill_expands_each_latent_cache_as_the_forward(params, kind)


@pytest.mark.parametrize("kind", ["paged", "int8"])
def test_the_absorbed_step_over_each_latent_cache_equals_the_expanded_forward(  # noqa: F811
    params, kind):
  unit_cases.check_the_absorbed_step_over_each_latent_cache_equals_the_expanded_forward(
      params, kind)
