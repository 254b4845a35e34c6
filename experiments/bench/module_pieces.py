"""Where a module's time goes: the linen SelfAttention in pieces, in JAX and in torch (CPU).

  python -m experiments.bench.modules --part pieces --ns 512 --turns 1 --rounds 3

The pieces (`jax_pieces`, `torch_pieces`), timed beside the whole module, each system's pieces
round-robin in its own processes (`experiments.bench.modules.time_case` runs them): the Q/K/V
projections, the same as one packed product (JAX only: torch's is the packed one), the
attention, the out projection, and the module written out by hand, token-major (as it runs) and
head-major (JAX only: `by_hand`). Each (N, mask) ends with the projections' ceiling: torch's
module time over our four projections' (Q/K/V and out), the best ratio to torch our module
could reach if everything else in it took no time.

  python -m experiments.bench.modules --part hlo --ns 512

compiles the module and the same written out head-major (`hlo_table`, never run) and counts
what XLA writes in its products, transposes, copies and slices.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

import flax_mha
from experiments.bench import hlo_bytes
from experiments.bench import module_cases as cases
from experiments.bench import timing

QKV = ("query", "key", "value")
PIECES = ("module", "q, k, v projections", "q, k, v packed", "attention", "out projection",
          "by hand, token-major", "by hand, head-major")
JAX_ONLY = ("q, k, v packed", "by hand, token-major", "by hand, head-major")


def _heads(shape, h: int) -> list[np.ndarray]:
  """Query, key and value [B, T, H, K] for the attention piece, x's shape [B, T, D] split into
  H heads, float32, NumPy-seeded."""
  b, n, d = shape
  return list(np.random.default_rng(2).standard_normal((3, b, n, h, d // h)).astype(np.float32))


def _cotangent(shape) -> np.ndarray:
  """A fixed random gradient of a piece's output, float32. The pieces' backward takes one in
  place of the gradient of a sum: with the sum, XLA drops a linear piece's products (the
  gradient of sum(x·W) w.r.t. W needs only x's column sums), which torch computes. (In the
  whole module it changes nothing: the same products compile either way.) Both the value
  and the gradient are computed, as torch does: a linear piece's gradient alone needs none of
  its forward."""
  return np.random.default_rng(3).standard_normal(shape).astype(np.float32)


def by_hand(causal: bool, *, head_major: bool):
  """The module's forward written out, params -> x [B, T, D] -> [B, T, D]: the projections,
  the attention `None` runs, the out projection. Head-major: each projection is written
  [B, H, T, K] (what torch's kernels take) and handed to the attention as its [B, T, H, K]
  view, which XLA folds into the kernel's own move of its inputs to head-major tiles: the
  program a head-major kernel entry compiles to."""
  def project(x, layer):
    if not head_major:
      return jnp.einsum("BTD,DHK->BTHK", x, layer["kernel"]) + layer["bias"]
    y = jnp.einsum("BTD,DHK->BHTK", x, layer["kernel"]) + layer["bias"][:, None]
    return y.transpose(0, 2, 1, 3)

  def forward(p, x):
    out = flax_mha.dot_product_attention(*(project(x, p[name]) for name in QKV),
                                         is_causal=causal)
    return jnp.einsum("BTHV,HVD->BTD", out, p["out"]["kernel"]) + p["out"]["bias"]

  return forward


def jax_pieces(d, h, causal, x) -> dict:
  """Calls of no arguments: each piece of the linen SelfAttention's forward ('<piece>|fwd') and
  its value and gradient w.r.t. all its arguments given a fixed random output gradient
  (`_cotangent`; '<piece>|fwd_bwd'), jitted: the module; the three DenseGeneral projections
  x [B, T, D] -> [B, T, H, K] with their biases; the same as one product with the kernels
  packed [D, 3·H, K] (as torch's in_proj_weight), split after (not what the module does: an
  idea, timed); the attention `None` runs, on [B, T, H, K] inputs as the module hands it; the
  out projection [B, T, H, V] -> [B, T, D] with its bias; and the module written out by hand
  (`by_hand`) token-major, as the module runs, and head-major (not what the module does: an
  idea, timed)."""
  apply, variables = cases.jax_module("self", "linen", d, h, cases.weights(d, h))
  p = variables["params"]
  q, k, v = map(jnp.asarray, _heads(x.shape, h))
  x = jnp.asarray(x)
  packed = [jnp.concatenate([p[name][w] for name in QKV], axis=-2) for w in ("kernel", "bias")]
  pieces = {
      "module": (lambda variables, x: apply(variables, x, is_causal=causal), (variables, x)),
      "q, k, v projections": (lambda p, x: [jnp.einsum("BTD,DHK->BTHK", x, p[name]["kernel"])
                                            + p[name]["bias"] for name in QKV], (p, x)),
      "q, k, v packed": (lambda w, b, x: jnp.split(jnp.einsum("BTD,DHK->BTHK", x, w) + b, 3,
                                                   axis=2), (*packed, x)),
      "attention": (lambda q, k, v: flax_mha.dot_product_attention(q, k, v, is_causal=causal),
                    (q, k, v)),
      "out projection": (lambda out, o: jnp.einsum("BTHV,HVD->BTD", o, out["kernel"])
                         + out["bias"], (p["out"], v)),
      "by hand, token-major": (by_hand(causal, head_major=False), (p, x)),
      "by hand, head-major": (by_hand(causal, head_major=True), (p, x)),
  }
  calls = {}
  for piece, (fn, args) in pieces.items():
    cotangents = [jnp.asarray(_cotangent(y.shape)) for y in jax.tree.leaves(jax.eval_shape(fn,
                                                                                      *args))]
    total = lambda *a, fn=fn, cotangents=cotangents: sum(
        jnp.vdot(y, c) for y, c in zip(jax.tree.leaves(fn(*a)), cotangents))
    calls[f"{piece}|fwd"] = timing.blocking(fn, *args)
    calls[f"{piece}|fwd_bwd"] = timing.blocking(
        jax.value_and_grad(total, argnums=tuple(range(len(args)))), *args)
  return calls


def torch_pieces(d, h, causal, x) -> dict:
  """torch's counterparts of `jax_pieces`: the module (SDPA path); the packed in-projection
  x [B, T, D] -> [B, T, 3·D]; scaled_dot_product_attention on [B, H, T, K] inputs and the
  merge of its output back to [B, T, H·V] (a copy, as the module makes); the out projection."""
  import torch  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(os.cpu_count() or 1)
  functional = torch.nn.functional
  module = torch.nn.MultiheadAttention(d, h, batch_first=True).eval()
  state = {k: torch.from_numpy(v.copy())
           for k, v in cases.to_torch_state(cases.weights(d, h)).items()}
  module.load_state_dict(state)
  b, n, _ = x.shape
  hide = torch.zeros(n, n).masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1),
                                       float("-inf"))
  masks = dict(attn_mask=hide, is_causal=True) if causal else {}
  leaf = lambda a: torch.from_numpy(np.ascontiguousarray(a)).requires_grad_()
  tx = leaf(x)
  qkv = [leaf(a.transpose(0, 2, 1, 3)) for a in _heads(x.shape, h)]  # torch's [B, H, T, K]
  w_in, b_in, w_out, b_out = (state[k].requires_grad_() for k in (
      "in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"))
  o = leaf(x)
  pieces = {
      "module": lambda: module(tx, tx, tx, need_weights=False, **masks)[0],
      "q, k, v projections": lambda: functional.linear(tx, w_in, b_in),
      "attention": lambda: functional.scaled_dot_product_attention(
          *qkv, is_causal=causal).transpose(1, 2).reshape(b, n, d),
      "out projection": lambda: functional.linear(o, w_out, b_out),
  }
  leaves = [tx, *qkv, w_in, b_in, w_out, b_out, o, *module.parameters()]

  def forward(fn):
    def call():
      torch.backends.mha.set_fastpath_enabled(False)  # the module's SDPA path, as fwd_bwd's
      try:
        with torch.no_grad():
          return fn()
      finally:
        torch.backends.mha.set_fastpath_enabled(True)
    return call

  def forward_backward(fn):
    cotangent = torch.from_numpy(_cotangent(tuple(forward(fn)().shape)))
    def call():
      for a in leaves:
        a.grad = None
      fn().backward(cotangent)
    return call

  calls = {}
  for piece, fn in pieces.items():
    calls[f"{piece}|fwd"], calls[f"{piece}|fwd_bwd"] = forward(fn), forward_backward(fn)
  return calls


def pieces_table(args) -> list[str]:
  """Markdown: each piece's ms in JAX and torch at each N and mask (each system's pieces timed
  round-robin in its own processes, the two systems' processes in turn; torch has no rows of
  JAX's alternatives, `JAX_ONLY`), and the projections' ceiling (the docstring)."""
  lines = [f"The linen SelfAttention's forward and forward+backward in pieces, D={args.d}, "
           f"H={args.heads}, B·N={args.tokens}; turns: {args.turns}, rounds per turn: "
           f"{args.rounds}; medians, ms. Share: of the module's time in the same system. "
           "Ceiling: torch's module over our four projections (Q/K/V and out), the best "
           "torch / ours the module could reach if nothing else in it took time.", "",
           "| N | mask | piece | ours fwd | torch fwd | ours share | torch share | ours fwd+bwd "
           "| torch fwd+bwd | ours share | torch share |", "|---|---|---|---|---|---|---|---|---|"
           "---|---|"]
  for n in args.ns:
    for mask in args.masks:
      reports = cases.run_cases({system: f"pieces,{system},{n},{int(cases.MASKS[mask])}"
                                   for system in ("jax", "torch")}, args)
      rows = _rows(f"| {n} | {mask} |", {system: cases.median_ms(report)
                                         for system, report in reports.items()})
      lines += rows
      print("\n".join(rows), flush=True)
  return lines


def _rows(lead: str, ms: dict) -> list[str]:
  """The table's rows of one (N, mask): each piece, then the projections' ceiling; ms:
  system ('jax', 'torch') -> '<piece>|<fwd or fwd_bwd>' -> ms."""
  rows = []
  for piece in PIECES:
    cells = []
    for kind in ("fwd", "fwd_bwd"):
      mine = [ms[system].get(f"{piece}|{kind}") for system in ("jax", "torch")]
      shares = [m and m / ms[system][f"module|{kind}"] for m, system in zip(mine,
                                                                            ("jax", "torch"))]
      cells += [f"{x:.1f}" if x else "—" for x in mine]
      cells += [f"{x:.2f}" if x else "—" for x in shares]
    rows.append(f"{lead} {piece} | " + " | ".join(cells) + " |")
  ceiling = lambda kind: ms["torch"][f"module|{kind}"] / sum(
      ms["jax"][f"{piece}|{kind}"] for piece in ("q, k, v projections", "out projection"))
  rows.append(f"{lead} ceiling (torch module / our projections) | {ceiling('fwd'):.2f} | | | | "
              f"{ceiling('fwd_bwd'):.2f} | | | |")
  return rows


def hlo_table(args) -> list[str]:
  """Markdown: `hlo_counts` of the jitted linen SelfAttention and of the same written out
  head-major (`by_hand`), forward and forward+backward (as timed: the loss and its
  gradients), at each N and mask (compiled, never run), beside the kernel `None` picks."""
  lines = [f"The jitted linen SelfAttention at D={args.d}, H={args.heads}, B·N={args.tokens}, "
           "and the same written out with head-major projections, compiled for this CPU (never "
           "run): instructions of each kind in the program / MiB they write per call (loop "
           "bodies times their trip count). See `hlo_bytes.hlo_counts`.", "",
           "| N | mask | kernel | program | pass | products | transpose | copy | slice | other "
           "| while |", "|---|---|---|---|---|---|---|---|---|---|---|"]
  for n in args.ns:
    b = max(1, args.tokens // n)
    for mask in args.masks:
      causal = cases.MASKS[mask]
      apply, variables = cases.jax_module("self", "linen", args.d, args.heads,
                                            cases.weights(args.d, args.heads))
      x = jax.ShapeDtypeStruct((b, n, args.d), jnp.float32)
      programs = {"module": (lambda variables, x: apply(variables, x, is_causal=causal),
                             variables),
                  "head-major": (by_hand(causal, head_major=True), variables["params"])}
      kernel = cases.picks(n, b, args.heads, args.d // args.heads, causal)
      for program, (forward, params) in programs.items():
        loss = lambda params, x, forward=forward: jnp.sum(forward(params, x))
        for name, fn in (("fwd", forward),
                         ("fwd+bwd", jax.value_and_grad(loss, argnums=(0, 1)))):
          counts = hlo_bytes.hlo_counts(jax.jit(fn).lower(params, x).compile().as_text())
          cell = lambda kind: f"{counts[kind][0]} / {counts[kind][1]:.1f}"
          lines.append(f"| {n} | {mask} | `{kernel}` | {program} | {name} | " + " | ".join(
              cell(kind) for kind in ("products", "transpose", "copy", "slice", "other")) +
                       f" | {counts['while'][0]} |")
          print(lines[-1], flush=True)
  return lines
