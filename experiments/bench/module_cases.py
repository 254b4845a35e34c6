"""The attention modules' benchmark cases (`experiments.bench.modules` and its pieces,
`experiments.bench.module_pieces`): the systems, shapes and weights every case shares, the
callables each system's worker times, and the workers' launch and reports."""

from __future__ import annotations

import os
import statistics

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads its OpenMP runtime

import jax
import jax.numpy as jnp
import numpy as np

import flax_mha
from experiments.bench import timing

ENTRIES = ("self", "cross")
SYSTEMS = ("torch", "linen", "nnx")
MASKS = {"plain": False, "causal": True}
# (entry, system) -> the module's name in the report.
NAMES = {("self", "linen"): "flax_mha.SelfAttention (linen)",
         ("self", "nnx"): "flax_mha.nn.nnx.SelfAttention",
         ("cross", "linen"): "flax_mha.MultiHeadAttention (linen, cross-attention)",
         ("cross", "nnx"): "flax_mha.nn.nnx.MultiHeadAttention (cross-attention)"}
PROBE = (2, 4)  # the output's and input gradient's [0, :2, :4] are compared across systems


def weights(d: int, h: int, seed: int = 0) -> dict:
  """{'params': ...} of `flax_mha.MultiHeadAttention(h)` at width d, NumPy float32: kernels
  [D, H, K] (out [H, V, D]) of scale D^-1/2, biases [H, K] (out [D]) of scale 0.1, so every
  bias matters."""
  rng = np.random.default_rng(seed)
  k = d // h
  normal = lambda scale, *shape: (scale * rng.standard_normal(shape)).astype(np.float32)
  params = {name: {"kernel": normal(d**-0.5, d, h, k), "bias": normal(0.1, h, k)}
            for name in ("query", "key", "value")}
  params["out"] = {"kernel": normal(d**-0.5, h, k, d), "bias": normal(0.1, d)}
  return {"params": params}


def to_torch_state(variables: dict) -> dict[str, np.ndarray]:
  """The `state_dict` of torch.nn.MultiheadAttention(D, H) (NumPy arrays) holding the weights
  of linen params {'params': {'query'|'key'|'value'|'out': {'kernel', 'bias'}}}.

  torch projects with x @ W.T + b, W [H·K, D] stacked as in_proj_weight [3·H·K, D] in query,
  key, value order, heads the contiguous K-wide slices of H·K: so W is the kernel [D, H, K]
  flattened to [D, H·K] and transposed, and out_proj.weight [D, H·V] the out kernel [H, V, D]
  flattened to [H·V, D] and transposed. `flax_mha.interop.from_torch_multihead_attention` is
  the inverse.
  """
  p = {name: {key: np.asarray(x) for key, x in layer.items()}
       for name, layer in variables["params"].items()}
  d = p["query"]["kernel"].shape[0]
  flat_DHK = lambda name: p[name]["kernel"].reshape(d, -1)
  return {
      "in_proj_weight": np.concatenate([flat_DHK(n).T for n in ("query", "key", "value")]),
      "in_proj_bias": np.concatenate([p[n]["bias"].reshape(-1) for n in ("query", "key", "value")]),
      "out_proj.weight": p["out"]["kernel"].reshape(-1, p["out"]["kernel"].shape[-1]).T,
      "out_proj.bias": p["out"]["bias"],
  }


def inputs(entry: str, b: int, n: int, d: int) -> list[np.ndarray]:
  """[x] (self) or [x, y] (cross), each [B, N, D] float32, NumPy-seeded."""
  rng = np.random.default_rng(1)
  return [rng.standard_normal((b, n, d)).astype(np.float32)
          for _ in range(1 if entry == "self" else 2)]


def jax_module(entry: str, system: str, d: int, h: int, variables: dict):
  """apply(params, *inputs, is_causal) -> [B, N, D] and its params: the linen module's apply on
  `variables`, or the NNX module (loaded with them) merged from its Param state inside."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from flax_mha.nn import nnx as flax_mha_nnx  # pylint: disable=import-outside-toplevel
  variables = jax.tree.map(jnp.asarray, variables)
  if system == "linen":
    module = (flax_mha.SelfAttention if entry == "self" else flax_mha.MultiHeadAttention)(h)
    return (lambda params, *xs, is_causal: module.apply(params, *xs, is_causal=is_causal),
            variables)
  cls = flax_mha_nnx.SelfAttention if entry == "self" else flax_mha_nnx.MultiHeadAttention
  module = flax_mha_nnx.linen_params_to_nnx(variables, cls(h, d, rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  return (lambda params, *xs, is_causal: nnx.merge(graphdef, params, rest)(
      *xs, is_causal=is_causal), params)


def jax_callables(entry, system, d, h, causal, xs):
  """(forward, forward+backward) of a JAX system as calls of no arguments that wait for their
  results, and the probe {'out', 'grad'} of its output and first input's gradient."""
  apply, params = jax_module(entry, system, d, h, weights(d, h))
  xs = [jnp.asarray(x) for x in xs]
  forward = lambda params, *xs: apply(params, *xs, is_causal=causal)
  loss = lambda params, *xs: jnp.sum(forward(params, *xs))
  # The loss and its gradients (params and every input), as torch computes both: with the
  # gradients alone XLA would skip the out projection's forward product.
  grads = jax.value_and_grad(loss, argnums=tuple(range(1 + len(xs))))
  fwd, fwd_bwd = timing.blocking(forward, params, *xs), timing.blocking(grads, params, *xs)
  probe = dict(out=_probe(fwd()), grad=_probe(fwd_bwd()[1][1]))
  return dict(fwd=fwd, fwd_bwd=fwd_bwd), probe


def _probe(x) -> list[float]:
  """x[0, :2, :4] flattened, as floats."""
  return np.asarray(x)[0, :PROBE[0], :PROBE[1]].ravel().tolist()


def torch_callables(entry, d, h, causal, xs):
  """torch.nn.MultiheadAttention's calls of no arguments: 'fwd native' (self-attention only)
  and 'fwd SDPA' (see the docstring) and 'fwd_bwd'; and its probe, the SDPA path's, after
  checking that the native path's output agrees."""
  import torch  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(os.cpu_count() or 1)
  module = torch.nn.MultiheadAttention(d, h, batch_first=True).eval()
  module.load_state_dict({k: torch.from_numpy(v.copy())
                          for k, v in to_torch_state(weights(d, h)).items()})
  x, *rest = (torch.from_numpy(a).requires_grad_() for a in xs)
  y = rest[0] if rest else x  # self-attention: the one tensor as query, key and value
  n = x.shape[1]
  hide = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)  # torch's True = hidden
  hide_float = torch.zeros(n, n).masked_fill(hide, float("-inf"))
  masks = lambda mask: dict(attn_mask=mask, is_causal=True) if causal else {}

  def call(mask):
    return module(x, y, y, need_weights=False, **masks(mask))[0]

  def fwd_native():
    with torch.no_grad():
      return call(hide)

  def fwd_sdpa():
    torch.backends.mha.set_fastpath_enabled(False)
    try:
      with torch.no_grad():
        return call(hide_float)
    finally:
      torch.backends.mha.set_fastpath_enabled(True)

  def fwd_bwd():
    module.zero_grad(set_to_none=True)
    x.grad = None
    if y is not x:
      y.grad = None
    call(hide_float).sum().backward()

  fwd_bwd()
  probe = dict(out=_probe(fwd_sdpa()), grad=_probe(x.grad))
  calls = {"fwd SDPA": fwd_sdpa, "fwd_bwd": fwd_bwd}
  if entry == "self":
    native = fwd_native().numpy()
    np.testing.assert_allclose(native, fwd_sdpa().numpy(), rtol=1e-4, atol=1e-4)
    calls["fwd native"] = fwd_native
  return calls, probe


def median_ms(reports: list) -> dict:
  """call -> the median ms over every worker's report of one case ({"seconds": {call: [s]}})."""
  pooled = {}
  for report in reports:
    for call, seconds in report["seconds"].items():
      pooled.setdefault(call, []).extend(seconds)
  return {call: 1e3 * statistics.median(s) for call, s in pooled.items()}


def run_cases(cases: dict[str, str], args) -> dict[str, list]:
  """system -> its workers' reports of its case (`cases`: system -> case, see `time_case`),
  each system in its own processes, in turn (`timing.isolated`), at this run's sizes."""
  extra = ["--d", str(args.d), "--heads", str(args.heads), "--tokens", str(args.tokens),
           "--rounds", str(args.rounds)]
  reports = timing.isolated("experiments.bench.modules", list(cases.values()),
                            turns=args.turns, extra_args=extra)
  return {system: reports[case] for system, case in cases.items()}


def picks(n: int, b: int, h: int, k: int, causal: bool) -> str:
  """The implementation `None` runs inside the modules at this shape."""
  shape = jax.ShapeDtypeStruct((b, n, h, k), jnp.float32)
  return flax_mha.explain(shape, shape, shape, is_causal=causal).implementation
