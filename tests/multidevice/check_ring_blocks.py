"""Run under XLA_FLAGS=--xla_force_host_platform_device_count=8
(tests/parallel/test_ring_integration.py does).

The ring's step kernel on an accelerator: each step runs the platform's Block, here flax_mha's
Triton kernel in Pallas interpret mode standing in for the CPU's chunked tiles, merged through
its lse forward and fed the global lse backward. Over 4 sequence shards (x 2 batch shards) and
each layout, values, loss and gradients equal single-device `flax_mha.kernels.reference`:
causal GQA with T != S, a window with a soft cap, segment ids with lengths, a key-padding mask;
a mask_mod (its arrays at true positions: refused by the Triton Block) falls back to chunked.
Then, with the CPU's Block restored, forward+backward of the ring exported for 'cuda' holds the
Triton kernels inside stage_accelerator_kernels() and not outside. Prints one 'OK ...' per check.
"""

import jax
import jax.numpy as jnp
import numpy as np

import flax_mha
from flax_mha import dispatch
from flax_mha.parallel import sharding
from flax_mha.kernels import registry
from flax_mha.parallel import ring as ring_lib
from flax_mha.kernels import triton
from flax_mha.parallel.seq_parallel import sequence_parallel_attention
from tests.multidevice.check_ring import B, H, check, loss_and_output, random_qkv

TRACED = []  # one entry per ring trace that stepped with the interpreted Triton Block


def _counted(fn):
  def run(*args, **kwargs):
    TRACED.append(fn.__name__)
    return fn(*args, **kwargs)
  return run


INTERPRETED = registry.Block(*map(_counted, triton.make_block(interpret=True)),
                             triton.options_reason)


def use_interpreted_blocks():
  """The interpreted Triton Block as the CPU's first choice for a ring step, added as any new
  step kernel is: its registration with its entry, its place in the dispatch's preference."""
  registry.register(registry.Kernel("triton_interpreted", triton.attention,
                                    triton.options_reason, "the Triton kernel, interpreted",
                                    layouts=("ring_block",),
                                    entries={"ring_block": INTERPRETED}))
  dispatch.STEP_PREFERENCE["ring_block"]["cpu"] = ("triton_interpreted", "chunked")
  said = ring_lib.explain_step(*(jax.ShapeDtypeStruct((B, 8, H, 16), jnp.float32),) * 3)
  assert said.implementation == "triton_interpreted", said


def restore_blocks():
  del dispatch.STEP_PREFERENCE["ring_block"]["cpu"]
  registry.unregister("triton_interpreted")
SEG = np.repeat(np.arange(3), [5, 9, 2])[None].repeat(B, 0)  # three documents in 16 tokens
CASES = {  # name -> (T, S, G, options)
    "gqa_causal": (8, 16, 3, dict(is_causal=True)),
    "window_soft_cap": (16, 16, 2, dict(is_causal=True, local_window_size=(5, 0),
                                        logit_soft_cap=2.0)),
    "segments_lengths": (16, 16, 6, dict(q_segment_ids=jnp.asarray(SEG),
                                         kv_segment_ids=jnp.asarray(SEG),
                                         key_value_seq_lengths=jnp.asarray([16, 11]))),
    "key_padding_mask": (8, 16, 3, dict(mask=jnp.asarray(np.arange(16) < 13)[None, None, None])),
}


def expected(q, k, v, options):
  single = lambda q, k, v: flax_mha.dot_product_attention(q, k, v, implementation="reference",
                                                          **options)
  (want_l, want_out), want_g = loss_and_output(single)(q, k, v)
  return want_out, want_l, want_g


def ring(layout, options):
  mesh = sharding.make_mesh(data=2, seq=4)
  return lambda q, k, v: sequence_parallel_attention(q, k, v, mesh=mesh, layout=layout,
                                                     batch_axis="data", **options)


def check_blocks(rng):
  use_interpreted_blocks()
  for name, (t, s, g, options) in CASES.items():
    q, k, v = random_qkv(rng, t, s, g)
    for layout in ("contiguous", "zigzag"):
      TRACED.clear()
      check(f"{name}/{layout}", ring(layout, options), (q, k, v), expected(q, k, v, options))
      assert {"forward", "backward"} <= set(TRACED), TRACED
  # A mask_mod reaches the ring as a function over the shards' true positions (arrays): the
  # Triton Block refuses it, so every platform steps with chunked's tiles, still exact.
  options = dict(mask_mod=lambda b, h, q, kv: (q + kv) % 3 != 1)
  q, k, v = random_qkv(rng, 8, 8, 3)
  TRACED.clear()
  check("mask_mod_falls_back", ring("contiguous", options), (q, k, v), expected(q, k, v, options))
  assert not TRACED, TRACED
  restore_blocks()


def check_export():
  x = jax.ShapeDtypeStruct((B, 16, H, 16), jnp.bfloat16)

  def loss(q, k, v):
    out = sequence_parallel_attention(q, k, v, mesh=sharding.make_mesh(data=2, seq=4),
                                      is_causal=True, batch_axis="data")
    return jnp.sum(out.astype(jnp.float32) ** 2)

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  checks = [jax.export.DisabledSafetyCheck.custom_call(triton.CUSTOM_CALL)]
  export = lambda: jax.export.export(fn, platforms=("cuda",), disabled_checks=checks)(
      x, x, x).mlir_module()
  assert "flax_mha_flash" not in export()
  with flax_mha.stage_accelerator_kernels():
    module = export()
  kernels = ("flax_mha_flash_forward", "flax_mha_flash_dq", "flax_mha_flash_dkv")
  assert all(name in module for name in kernels) and "collective_permute" in module
  print("OK export_cuda_triton_steps")


def main():
  assert jax.device_count() == 8, jax.device_count()
  rng = np.random.default_rng(0)
  check_blocks(rng)
  check_export()


if __name__ == "__main__":
  main()
