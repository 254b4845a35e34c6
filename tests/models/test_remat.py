"""flax_mha.remat: remat_implementation gives the plain call's values and gradients, the policy
helpers apply their own policy alone, bad values are named. The models recomputing under each
policy are in tests/models/test_remat_integration.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_mha
from flax_mha import remat
from flax_mha.models.lm import DecoderLM, LMConfig
from flax_mha.models.transformer import TransformerConfig
from helpers import qkv

VOCAB, B, L = 13, 3, 10


@pytest.mark.parametrize("implementation", [None, "xla", "chunked"])
def test_remat_implementation_equals_the_plain_call(rng, implementation):
  """The pure API: values and gradients of q, k, v and the sinks, causal with segment ids."""
  q, k, v = qkv(rng, s=5)  # T == S: one segment id array serves both sides
  segments = jnp.asarray(np.sort(rng.integers(0, 3, q.shape[:2]), axis=-1))
  sinks = jnp.asarray(rng.standard_normal(q.shape[-2]), jnp.float32)

  def run(impl):
    def loss(q, k, v, sinks):
      out = flax_mha.dot_product_attention(q, k, v, is_causal=True, q_segment_ids=segments,
                                           kv_segment_ids=segments, sinks=sinks,
                                           implementation=impl)
      return jnp.sum(jnp.sin(out))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)

  (got, got_grads), (want, want_grads) = run(remat.remat_implementation(implementation)), run(
      implementation)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got_grads, want_grads):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("make, value, error, message", [
    (lambda r: TransformerConfig(vocab_size=VOCAB, remat=r), "all", ValueError,
     "TransformerConfig.remat must be one of ['none', 'layer', 'attention'], got 'all'"),
    (lambda r: LMConfig(vocab_size=VOCAB, remat=r), True, TypeError,
     "LMConfig.remat must be a string, one of ['none', 'layer', 'attention'], got bool"),
    (remat.remat_implementation, "flash", ValueError, "implementation must be None, a callable"),
])
def test_bad_remat_values_raise_naming_the_argument(make, value, error, message):
  with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
    make(value)


def test_policy_helpers_apply_only_their_own_policy():
  """The one reading of `remat` both models use (values: the test above)."""
  assert remat.attention_implementation("none", "xla") == "xla"
  assert remat.attention_implementation("layer", "xla") == "xla"
  assert remat.attention_implementation("attention", "xla").__name__ == "remat_xla"
  assert remat.layer_class("none", DecoderLM, (1,)) is DecoderLM
  assert remat.layer_class("attention", DecoderLM, (1,)) is DecoderLM
  assert remat.layer_class("layer", DecoderLM, (1,)) is not DecoderLM
