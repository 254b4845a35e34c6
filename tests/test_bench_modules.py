"""experiments.bench.modules times systems that compute one function: flax_mha's modules and
torch.nn.MultiheadAttention on the same weights agree (outputs, input and parameter gradients),
and so do its workers' probes. torch and JAX share this process: a correctness check, nothing
here is timed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flax_mha  # pylint: disable=wrong-import-position
from experiments.bench import hlo_bytes  # pylint: disable=wrong-import-position
from experiments.bench import module_cases as cases  # pylint: disable=wrong-import-position
from experiments.bench import module_pieces  # pylint: disable=wrong-import-position
from experiments.bench import modules as bench  # pylint: disable=wrong-import-position
from flax_mha import interop  # pylint: disable=wrong-import-position

H, K, B, N = 2, 7, 3, 5  # torch's fast path needs an even head count; the rest prime
D = H * K


def test_to_torch_state_is_interops_inverse():
  """Packing flax's kernels into torch's layout, then reading them back with
  flax_mha.interop, gives the same params."""
  variables = cases.weights(D, H)
  back = interop.from_torch_multihead_attention(cases.to_torch_state(variables), H)
  jax.tree.map(np.testing.assert_array_equal, back, variables)


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
@pytest.mark.parametrize("entry", cases.ENTRIES)
def test_linen_module_matches_torch(entry, causal):
  """The linen module and torch.nn.MultiheadAttention, same weights: output, the gradients of
  its sum w.r.t. every input and every parameter (torch's mapped with `to_torch_state`)."""
  variables = cases.weights(D, H)
  xs = cases.inputs(entry, B, N, D)
  module = (flax_mha.SelfAttention if entry == "self" else flax_mha.MultiHeadAttention)(H)
  apply = lambda params, *xs: module.apply(params, *xs, is_causal=causal)
  out = apply(variables, *xs)
  grads = jax.grad(lambda *a: jnp.sum(apply(*a)), argnums=tuple(range(1 + len(xs))))(
      variables, *xs)

  mha = torch.nn.MultiheadAttention(D, H, batch_first=True)
  mha.load_state_dict({k: torch.from_numpy(v.copy())
                       for k, v in cases.to_torch_state(variables).items()})
  tx = [torch.from_numpy(x).requires_grad_() for x in xs]
  key = tx[-1]  # self: the query itself
  hide = torch.triu(torch.ones(N, N, dtype=torch.bool), 1)  # torch: True = hidden
  kwargs = dict(attn_mask=hide, is_causal=True) if causal else {}
  t_out = mha(tx[0], key, key, need_weights=False, **kwargs)[0]
  t_out.sum().backward()

  close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                                                  atol=1e-4)
  close(out, t_out.detach())
  for grad, x in zip(grads[1:], tx):
    close(grad, x.grad)
  ours = cases.to_torch_state(grads[0])
  for name, param in mha.named_parameters():
    close(ours[name], param.grad)


@pytest.mark.parametrize("entry, causal", [("self", False), ("cross", True)])
def test_workers_agree(entry, causal):
  """Every system's worker (run here in-process) reports the probe torch's does, and both
  torch forward paths where there are two (the worker checks that they agree). One mask per
  entry: the test above covers both."""
  reports = {system: bench.time_case(f"{entry},{system},{N},{int(causal)}", d=D, h=H,
                                     tokens=B * N, rounds=1)
             for system in cases.SYSTEMS}
  bench.agree({system: report["probe"] for system, report in reports.items()})
  want = {"fwd SDPA", "fwd_bwd"} | ({"fwd native"} if entry == "self" else set())
  assert set(reports["torch"]["seconds"]) == want
  assert set(reports["linen"]["seconds"]) == {"fwd", "fwd_bwd"}


def test_agree_refuses_a_different_function():
  probe = dict(out=[1.0, 2.0], grad=[0.5, 0.5])
  bench.agree({"torch": probe, "linen": dict(probe)})
  with pytest.raises(RuntimeError, match="different functions"):
    bench.agree({"torch": probe, "linen": dict(probe, grad=[0.5, 0.6])})


def test_hlo_counts_reads_transposes_and_loops():
  """A transpose writes its result; a loop's dynamic-update-slice writes its update in place,
  once per trip (4 trips of a [16, 32] float32 slice: 8 KiB, not 4 x the whole array)."""
  kib = 2**-10  # in MiB
  x = jnp.zeros((64, 32), jnp.float32)
  counts = hlo_bytes.hlo_counts(jax.jit(lambda x: x.T * 2).lower(x).compile().as_text())
  assert counts["transpose"] == [1, 8 * kib]
  assert counts["products"][0] == counts["slice"][0] == counts["while"][0] == 0

  def rows(y):
    step = lambda i, y: jax.lax.dynamic_update_slice(
        y, jnp.sin(jax.lax.dynamic_slice(y, (i * 16, 0), (16, 32))), (i * 16, 0))
    return jax.lax.fori_loop(0, 4, step, y)

  counts = hlo_bytes.hlo_counts(jax.jit(rows).lower(x).compile().as_text())
  assert counts["while"][0] == 1
  assert counts["slice"] == [1, 4 * 2 * kib]


def test_pieces_workers_and_the_projections_ceiling():
  """The pieces' workers (in-process) time every piece, torch all but JAX's alternatives (its
  projection is the packed one); the module by hand, token- or head-major, computes the
  module's function; the ceiling is torch's module over our four projections."""
  reports = {system: bench.time_case(f"pieces,{system},{N},1", d=D, h=H, tokens=B * N,
                                     rounds=1) for system in ("jax", "torch")}
  calls = lambda pieces: {f"{p}|{kind}" for p in pieces for kind in ("fwd", "fwd_bwd")}
  assert set(reports["jax"]["seconds"]) == calls(module_pieces.PIECES)
  assert set(reports["torch"]["seconds"]) == calls(
      p for p in module_pieces.PIECES if p not in module_pieces.JAX_ONLY)
  apply, variables = cases.jax_module("self", "linen", D, H, cases.weights(D, H))
  x = jnp.asarray(cases.inputs("self", B, N, D)[0])
  for head_major in (False, True):
    np.testing.assert_allclose(module_pieces.by_hand(True, head_major=head_major)(
        variables["params"], x), apply(variables, x, is_causal=True), rtol=1e-5, atol=1e-5)
  ms = {system: cases.median_ms([report]) for system, report in reports.items()}
  assert len(module_pieces._rows("| 5 | causal |", ms)) == len(module_pieces.PIECES) + 1
  made_up = {"torch": {"module|fwd": 120.0, "module|fwd_bwd": 330.0},
             "jax": {"module|fwd": 100.0, "module|fwd_bwd": 300.0}}
  for piece, fwd in (("q, k, v projections", 50.0), ("out projection", 10.0)):
    made_up["jax"].update({f"{piece}|fwd": fwd, f"{piece}|fwd_bwd": 2 * fwd})
  ceiling = module_pieces._rows("| 5 | causal |", made_up)[-1]
  cells = [cell.strip() for cell in ceiling.split("|")[1:-1]]  # the table's 11 columns
  assert cells[3:] == ["2.00", "", "", "", "2.75", "", "", ""], ceiling
