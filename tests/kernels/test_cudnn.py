"""flax_mha.kernels.cudnn: the GPU path equals the float32 reference; off a GPU it says why it can't run.

The GPU tests run where JAX sees a CUDA device (e.g. `python -m pytest tests/kernels/test_cudnn.py`
on the lent H100) and are skipped elsewhere.
"""

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_mha
from flax_mha import attention as attention_lib
from flax_mha.kernels import cudnn

ON_GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="cuDNN needs a CUDA GPU")
B, T, S, H, G, K = 2, 136, 72, 8, 2, 64  # lengths not multiples of cuDNN's 64/128 tiles


def _inputs(dtype=jnp.bfloat16):
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (B, T, H, K), dtype)
  k = jax.random.normal(keys[1], (B, S, G, K), dtype)
  v = jax.random.normal(keys[2], (B, S, G, K), dtype)
  lengths = jnp.array([S, S // 3])
  mask = (jnp.arange(S) < lengths[:, None])[:, None, None, :]  # [B, 1, 1, S] key padding
  mask = mask & jnp.ones((B, 1, T, S), bool).at[1, :, 5].set(False)  # row 5 of batch 1: no key
  return q, k, v, mask


@gpu_only
@pytest.mark.parametrize("use_mask,is_causal", list(itertools.product([False, True], repeat=2)))
def test_matches_reference_values_and_grads(use_mask, is_causal):
  q, k, v, mask = _inputs()
  mask = mask if use_mask else None

  def loss(name):
    return lambda q, k, v: jnp.sum(flax_mha.dot_product_attention(
        q, k, v, mask=mask, is_causal=is_causal, implementation=name).astype(jnp.float32) ** 2)

  # cuDNN in bf16 must be as close to the float32 oracle as our own bf16 graph ("xla", which
  # rounds the weights to bf16 before the value product, as flash kernels do), within 2x.
  f32 = lambda x: x.astype(jnp.float32)
  run = lambda name, *a: flax_mha.dot_product_attention(*a, mask=mask, is_causal=is_causal,
                                                        implementation=name)
  out, out_xla = run("cudnn", q, k, v), run("xla", q, k, v)
  ref = run("reference", f32(q), f32(k), f32(v))
  chex.assert_shape(out, (B, T, H, K))
  err = lambda got, want: float(jnp.max(jnp.abs(f32(got) - want)))
  assert err(out, ref) <= 2 * err(out_xla, ref) + 1e-3, (err(out, ref), err(out_xla, ref))
  grads = jax.jit(jax.grad(loss("cudnn"), argnums=(0, 1, 2)))(q, k, v)
  grads_xla = jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2)))(q, k, v)
  ref_grads = jax.grad(loss("reference"), argnums=(0, 1, 2))(f32(q), f32(k), f32(v))
  for got, ours, want in zip(grads, grads_xla, ref_grads):
    assert np.all(np.isfinite(f32(got)))
    bound = 2 * err(ours, want) + 1e-3 * float(jnp.max(jnp.abs(want)))
    assert err(got, want) <= bound, (err(got, want), bound)


@gpu_only
def test_default_picks_cudnn_for_bf16_on_gpu():
  q, k, v, _ = _inputs()
  assert attention_lib.default_implementation(q, k, v, None, None, is_causal=False,
                                                dropout_rate=0.0) == "cudnn"
  with_dropout = attention_lib.default_implementation(q, k, v, None, None, is_causal=False,
                                                     dropout_rate=0.1)
  assert with_dropout != "cudnn"


def test_reasons_name_the_constraint():
  q, k, v, _ = _inputs(jnp.float32)
  reason = cudnn.unsupported_reason(q, k, v, 0.0)
  assert reason is not None and ("GPU" in reason or "bfloat16" in reason)
  with pytest.raises(ValueError, match="implementation='cudnn' cannot run"):
    flax_mha.dot_product_attention(q, k, v, implementation="cudnn")


def test_refuses_options_by_name():
  q, k, v, _ = _inputs(jnp.float32)
  with pytest.raises(ValueError, match="implementation='cudnn' cannot run"):  # T == S: a window
    flax_mha.dot_product_attention(q[:, :S], k, v, local_window_size=3, implementation="cudnn")
