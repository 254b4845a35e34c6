"""Platforms: which one a process has, what `implementation=None` stages for the ones it lacks,
and which one a kernel is for, said where JAX lowers it.

`only_on(platform, name, *arrays)` is the identity on `arrays`, staged as a primitive that lowers
to nothing for `platform` and refuses, naming the kernel, to lower for any other. A kernel for
one accelerator (splash for 'tpu', the Triton kernels for 'cuda') passes its operands and its
results through it, so that a program lowered where the kernel cannot run (a CPU, or an export
for several platforms at once, where JAX lowers every staged branch for each platform) stops
with a sentence naming the kernel and the way out, before Pallas's own error ("Only interpret
mode is supported on CPU backend"). Its derivative and batching are the identity's, through
the same primitive, so a backward pass is named as well.
"""

from __future__ import annotations

import functools

import jax
# jax's own config states are the one way to make a setting part of jit's cache keys: the
# trace cache's (include_in_trace_context) and the C++ dispatch cache's (include_in_jit_key,
# without which a function called before the setting changed keeps its old program).
from jax._src import config as jax_config
from jax.extend import core as jex_core
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir

LOWERED_FOR = ("cpu", "cuda", "rocm", "tpu")  # the platforms JAX lowers for (their rules)


def backend_platform() -> str:
  """The default backend as `lax.platform_dependent` names platforms: 'cpu', 'cuda', 'rocm' or
  'tpu' (jax.default_backend() says 'gpu' for both GPU kinds)."""
  backend = jax.default_backend()
  if backend != "gpu":
    return backend
  return "rocm" if "rocm" in jax.devices()[0].client.platform_version.lower() else "cuda"


def has_platform(platform: str) -> bool:
  """Whether this process has devices of `platform` ('cuda', ...): what tracing needs when a
  library reads the hardware while it traces (jax.nn's cuDNN path does)."""
  try:
    return bool(jax.devices(platform))
  except RuntimeError:
    return False


# Whether `implementation=None` stages, for an accelerator this process does not have, the kernels
# that are otherwise staged only where that hardware is (splash for 'tpu', the Triton kernel for
# 'cuda'): set by `flax_mha.stage_accelerator_kernels()`, the FLAX_MHA_STAGE_ACCELERATOR_KERNELS
# environment variable or `jax.config.update("flax_mha_stage_accelerator_kernels", True)`.
STAGE_ACCELERATOR_KERNELS = jax_config.bool_state(
    name="flax_mha_stage_accelerator_kernels", default=False,
    help="flax_mha: implementation=None stages accelerator kernels (splash, triton) in a "
         "process without that accelerator, for jax.export",
    include_in_jit_key=True, include_in_trace_context=True)


def stages_for(platform: str) -> bool:
  """Whether None may stage for `platform` a kernel it otherwise stages only where that hardware
  is: this process has devices of `platform`, or STAGE_ACCELERATOR_KERNELS is on."""
  return STAGE_ACCELERATOR_KERNELS.value or has_platform(platform)


def check_staged(platform: str, name: str, interpret: bool) -> None:
  """Refuse, naming kernel `name` and the ways to run it, to trace a `platform` kernel that
  runs compiled (not `interpret`) in a process that neither has `platform` nor stages it."""
  if interpret or stages_for(platform):
    return
  raise ValueError(
      f"implementation {name!r} is a {platform!r} kernel and this process has no "
      f"{platform!r} device (its backend: {backend_platform()!r}). To run it here, run it in "
      f"Pallas interpret mode (flax_mha.kernels.{name}.make_attention(interpret=True)); to "
      f"export it for {platform!r} from here, trace it inside "
      "flax_mha.stage_accelerator_kernels().")

_only_on_p = jex_core.Primitive("flax_mha_only_on")
_only_on_p.multiple_results = True


def only_on(platform: str, name: str, *arrays):
  """`arrays`, unchanged, marked as the operands or results of kernel `name` for `platform`."""
  if not arrays:
    return arrays
  return tuple(_only_on_p.bind(*arrays, platform=platform, name=name))


def kernel_for(platform: str, name: str, interpret: bool, attention):
  """`attention` (a kernel's function: arrays first, options by keyword) as the `platform`
  kernel `name`: run compiled (not `interpret`), it is refused by name where it cannot be
  traced (`check_staged`) or lowered (`only_on` around its array operands and results)."""
  if interpret:
    return attention

  @functools.wraps(attention)
  def marked(*arrays, **options):
    check_staged(platform, name, interpret)
    mark = lambda x: only_on(platform, name, x)[0] if _floating(x) else x
    results = attention(*(mark(a) for a in arrays), **options)
    return jax.tree.map(mark, results)
  return marked


def _floating(x) -> bool:
  return hasattr(x, "dtype") and jax.numpy.issubdtype(x.dtype, jax.numpy.floating)


def cannot_lower(name: str, platform: str, lowered_for: str) -> str:
  """The refusal of kernel `name`, for `platform`, lowered for `lowered_for`."""
  return (f"implementation {name!r} is a {platform!r} kernel and cannot be lowered for "
          f"{lowered_for!r}. To run it on this machine, run it in Pallas interpret mode "
          f"(flax_mha.kernels.{name}.make_attention(interpret=True)); to ship it, export for "
          f"{platform!r} alone (jax.export.export(..., platforms=({platform!r},)) inside "
          "flax_mha.stage_accelerator_kernels()). An export for several platforms at once lowers "
          "every staged kernel for each of them: export those with flax_mha's accelerator "
          "kernels unstaged (outside stage_accelerator_kernels()), where None runs XLA.")


def _rule_for(lowered_for: str):
  def rule(ctx, *args, platform, name):
    del ctx
    if platform != lowered_for:
      raise ValueError(cannot_lower(name, platform, lowered_for))
    return args
  return rule


for _platform in LOWERED_FOR:
  mlir.register_lowering(_only_on_p, _rule_for(_platform), platform=_platform)

_only_on_p.def_abstract_eval(lambda *avals, platform, name: avals)
_only_on_p.def_impl(lambda *arrays, platform, name: jax.jit(
    lambda *xs: only_on(platform, name, *xs))(*arrays))


def _jvp(primals, tangents, *, platform, name):
  tangents = [ad.instantiate_zeros(t) for t in tangents]
  return only_on(platform, name, *primals), only_on(platform, name, *tangents)


def _transpose(cotangents, *arrays, platform, name):
  del arrays
  cotangents = [ad.instantiate_zeros(c) for c in cotangents]
  return only_on(platform, name, *cotangents)


def _batch(args, dims, *, platform, name):
  return only_on(platform, name, *args), dims


ad.primitive_jvps[_only_on_p] = _jvp
ad.primitive_transposes[_only_on_p] = _transpose
batching.primitive_batchers[_only_on_p] = _batch
