"""Attention speed and memory: flax_mha's implementations against jax.nn, flax.linen, tokamax and torch.

  python -m experiments.bench.attention [--quick]   # CPU, float32 -> docs/benchmark_cpu.*
  python -m experiments.bench.attention --part protocol --out docs/benchmark_cpu_protocol.md
  python -m experiments.bench.attention --part layout --out docs/benchmark_cpu_layout.md
  python -m experiments.bench.attention --part memory --out docs/benchmark_cpu_memory.md
  python -m experiments.bench.attention --device gpu --dtype bfloat16 --json gpu.json
  python -m experiments.bench.attention --device tpu --json tpu.json   # bfloat16

Speed: forward and forward+backward, H=8, B·N = 4096 (B >= 1), causal and not; every peer in its
native layout (transposes outside the timing). Protocol: for each shape, every system (ours,
jax.nn, flax.linen, tokamax, torch SDPA, and a 2048² matmul in jnp and in torch) is timed in a
process of its own, the processes taking turns `--alternations` times (the order reversed
every other turn); in its process a system is compiled and run twice, then its forward and its
forward+backward are timed in turn for `--rounds` rounds. Cells are medians over all rounds of
all turns. Systems share no process because sharing one changes their times: `--part protocol`
measures it, timing `None` alone against `None` among every JAX peer in one process, and torch
alone against torch beside JAX (the protocol before this one). `--part layout` times, at the
small shapes (N <= 512, non-causal), `None` beside the same plain graph given its inputs already
in torch's [B, H, N, D] layout (no transpose in its program) and torch SDPA: what the API's
[B, N, H, D] layout costs on XLA:CPU and what remains without it. tokamax is an optional peer
(`pip install tokamax`), timed where it imports. FLOPs: forward 4·B·H·N²·D (halved when
causal), forward + backward 3.5x that. Memory: XLA's temp bytes of the compiled
forward+backward.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads its OpenMP runtime

import flax.linen as nn
import jax
import jax.numpy as jnp

import flax_mha
from experiments.bench import timing
from experiments.bench.attention_report import markdown, plot, write, write_json
from flax_mha import attention as attention_lib
from flax_mha import masks as masks_lib
from flax_mha.kernels import chunked, xla
from flax_mha.kernels import rows as rows_lib

GIB = 2**30
TORCH = ("torch", "peak torch")  # the systems timed in torch; every other one is JAX's
HEAD_MAJOR = "head-major plain graph"  # --part layout: inputs transposed before timing


def _head_major_plain(q_BHNK, k_BHNK, v_BHNK, causal):
  """`xla`'s plain graph (scaled query, product, library softmax, product) on inputs already
  in torch's [B, H, N, D] layout, the output left in it: nothing for XLA to transpose."""
  logits = jnp.einsum("BHTK,BHSK->BHTS", q_BHNK * q_BHNK.shape[-1]**-0.5, k_BHNK)
  if causal:
    visible = masks_lib.causal_mask(logits.shape[-1])
    logits = logits + jnp.where(visible, 0.0, jnp.finfo(logits.dtype).min)
  return jnp.einsum("BHTS,BHSV->BHTV", jax.nn.softmax(logits, axis=-1), v_BHNK)


def _tokamax_peers(device):
  """tokamax's implementations for this device, or {} where tokamax does not import."""
  tokamax = timing.import_tokamax()
  if tokamax is None:
    return {}
  names = {"gpu": ("mosaic", "triton", "xla"), "tpu": ("mosaic", "xla")}.get(
      device, ("xla", "xla_chunked"))
  return {f"tokamax {name}": lambda q, k, v, c, name=name: tokamax.dot_product_attention(
      q, k, v, is_causal=c, implementation=name) for name in names}


def _jax_peers(device):
  """name -> fn(q, k, v, causal) in the [B, N, H, D] layout."""
  ours = lambda name: lambda q, k, v, c: flax_mha.dot_product_attention(
      q, k, v, is_causal=c, implementation=name)
  peers = {"chunked": ours("chunked"), "default": ours(None)}
  if device == "gpu":  # None runs cuDNN where it applies, the Triton kernel where not
    peers["cudnn"] = ours("cudnn")
    peers["triton"] = ours("triton")
    peers["jax.nn xla"] = lambda q, k, v, c: jax.nn.dot_product_attention(
        q, k, v, is_causal=c, implementation="xla")
    peers["jax.nn cudnn"] = lambda q, k, v, c: jax.nn.dot_product_attention(
        q, k, v, is_causal=c, implementation="cudnn")
    return {**peers, **_tokamax_peers(device)}
  if device == "tpu":  # None runs splash where it takes the call, named too
    peers["splash"] = ours("splash")
    peers["jax.nn xla"] = lambda q, k, v, c: jax.nn.dot_product_attention(
        q, k, v, is_causal=c, implementation="xla")
    return {**peers, **_tokamax_peers(device)}
  peers["rows"] = ours("rows")
  peers["xla"] = ours("xla")
  peers["reference"] = ours("reference")  # the untuned oracle
  peers["jax.nn"] = lambda q, k, v, c: jax.nn.dot_product_attention(q, k, v, is_causal=c)
  peers["flax.linen"] = lambda q, k, v, c: nn.dot_product_attention(
      q, k, v, mask=nn.make_causal_mask(jnp.ones(q.shape[:2], bool)) if c else None)
  return {**peers, **_tokamax_peers(device)}


def _jax_callables(fn, q, k, v, causal):
  loss = lambda q, k, v: jnp.sum(fn(q, k, v, causal).astype(jnp.float32))
  return (timing.blocking(lambda q, k, v: fn(q, k, v, causal), q, k, v),
          timing.blocking(timing.qkv_grad(loss), q, k, v))


def _torch_callables(q, k, v, causal, device):
  """torch SDPA in its [B, H, N, D] layout (forward, forward+backward)."""
  import torch  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(os.cpu_count() or 1)
  dev = "cuda" if device == "gpu" else "cpu"
  to = lambda x: torch.tensor(jnp.asarray(x, jnp.float32).transpose(0, 2, 1, 3).__array__(),
                              dtype=getattr(torch, str(q.dtype)), device=dev, requires_grad=True)
  tq, tk, tv = to(q), to(k), to(v)
  sdpa = torch.nn.functional.scaled_dot_product_attention
  sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

  def fwd():
    with torch.no_grad():
      sdpa(tq, tk, tv, is_causal=causal)
    sync()

  def fwd_bwd():
    sdpa(tq, tk, tv, is_causal=causal).float().sum().backward()
    sync()

  return fwd, fwd_bwd


def _peak_callable(name, device, n=2048):
  """fn() of an n x n float32 product in jnp ("peak jax") or torch ("peak torch")."""
  a = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  if name == "peak jax":
    return timing.blocking(lambda a: a @ a, a)
  import torch  # pylint: disable=import-outside-toplevel
  ta = torch.tensor(a.__array__(), device="cuda" if device == "gpu" else "cpu")
  return lambda: torch.mm(ta, ta)


def _skip(name, n, device):
  """Budget for the CPU run: the O(N²)-memory XLA peers stop at N = 4096, our `xla` and
  tokamax's chunked one (4-8x ours) at 2048, the untuned oracle at 512; 'default' is timed as
  the implementation it picks."""
  if device != "cpu" or name in ("chunked", "rows", "torch") or name.startswith("peak"):
    return False
  if name == "default":
    return True
  limits = {"reference": 512, "xla": 2048, "tokamax xla_chunked": 2048}
  return n > limits.get(name, 4096)


def has_torch(device) -> bool:
  """Whether torch imports here and, for device "gpu", sees a CUDA device (checked in this
  process, which times nothing); never on "tpu"."""
  if device == "tpu" or importlib.util.find_spec("torch") is None:
    return False
  if device != "gpu":
    return True
  import torch  # pylint: disable=import-outside-toplevel
  return torch.cuda.is_available()


def _extend(times: dict, key, fwd, fwd_bwd) -> None:
  """times[key] = ([fwd seconds], [fwd+bwd seconds]), extended by one worker's."""
  mine = times.setdefault(key, ([], []))
  mine[0].extend(fwd)
  mine[1].extend(fwd_bwd)


def time_case(d, n, causal, systems, *, dtype, device, rounds, tokens):
  """Worker: name -> [[fwd seconds...], [fwd+bwd seconds...]] of each of `systems` (peer
  names, "torch", "peak jax", "peak torch") at one shape, timed round-robin in this process."""
  b = max(1, tokens // n)
  q, k, v = (jax.random.normal(key, (b, n, 8, d), dtype)
             for key in jax.random.split(jax.random.key(0), 3))
  peers = _jax_peers(device) if set(systems) - {*TORCH, "peak jax", HEAD_MAJOR} else {}
  calls = {}
  for name in systems:
    if name.startswith("peak"):
      calls[name, 0] = _peak_callable(name, device)
      continue
    if name == "torch":
      fns = _torch_callables(q, k, v, causal, device)
    elif name == HEAD_MAJOR:
      fns = _jax_callables(_head_major_plain, *(x.transpose(0, 2, 1, 3) for x in (q, k, v)),
                           causal)
    else:
      fns = _jax_callables(peers[name], q, k, v, causal)
    calls.update({(name, i): fn for i, fn in enumerate(fns)})
  times = timing.round_robin(calls, rounds, rotate=True)
  out = {}
  for (name, i), seconds in times.items():
    out.setdefault(name, [[], []])[i] = seconds
  return out


def _worker_args(d, n, causal, args) -> list[str]:
  """What a worker timing one shape is told besides its systems (`--time-case`)."""
  return ["--shape", f"{d},{n},{int(causal)}", "--device", args.device, "--dtype", args.dtype,
          "--tokens", str(args.tokens), "--rounds", str(args.rounds)]


def _alternate(d, n, causal, groups, args) -> dict:
  """name -> ([fwd seconds], [fwd+bwd seconds]) over `args.alternations` turns of the process
  groups, each group in its own process, the order reversed every other turn."""
  reports = timing.isolated("experiments.bench.attention", [",".join(g) for g in groups],
                            turns=args.alternations, extra_args=_worker_args(d, n, causal, args))
  times = {}
  for mine in reports.values():
    for report in mine:
      for name, (fwd, fwd_bwd) in report.items():
        _extend(times, name, fwd, fwd_bwd)
  return times


def speed(grid, args):
  """One row per (shape, system): medians of the alternating per-process protocol."""
  rows = []
  jax_names = list(_jax_peers(args.device))
  for d, n, causal in grid:
    b = max(1, args.tokens // n)
    groups = [[name] for name in jax_names if not _skip(name, n, args.device)] + [["peak jax"]]
    if has_torch(args.device):
      groups += [[name] for name in TORCH]
    times = _alternate(d, n, causal, groups, args)
    median = {name: tuple(statistics.median(t) if t else None for t in pair)
              for name, pair in times.items()}
    peak = max(2 * 2048**3 / median[name][0] / 1e9 for name in ("peak jax", "peak torch")
               if name in median)
    shape = jax.ShapeDtypeStruct((b, n, 8, d), jnp.dtype(args.dtype))
    picked = attention_lib.default_implementation(shape, shape, shape, None, None,
                                                  is_causal=causal, dropout_rate=0.0)
    if "default" not in median and picked in median:
      median["default"] = median[picked]
    flops = 4 * b * 8 * n * n * d / (2 if causal else 1)
    for name, (t_fwd, t_fb) in median.items():
      if name.startswith("peak"):
        continue
      rows.append(dict(impl=name, D=d, N=n, B=b, causal=causal, fwd_ms=1e3 * t_fwd,
                       fwd_bwd_ms=1e3 * t_fb, fwd_gflops=flops / t_fwd / 1e9,
                       fwd_bwd_gflops=3.5 * flops / t_fb / 1e9, matmul_peak_gflops=peak,
                       picks=picked if name == "default" else None))
    print(f"D={d} N={n} causal={causal}: " + ", ".join(
        f"{name} {t[0]*1e3:.2f}/{t[1]*1e3:.2f} ms" for name, t in median.items()
        if not name.startswith("peak")) + f"; matmul peak {peak:.0f} GFLOP/s", flush=True)
    if args.json:  # after every shape: an interrupted run keeps what it measured
      write_json(args.json, rows)
  return rows


def protocol(case, args) -> list[str]:
  """Markdown: whether sharing a process changes a system's time (see the docstring)."""
  d, n, causal = case
  others = [name for name in _jax_peers(args.device) if not _skip(name, n, args.device)]
  settings = {"`None` alone": ["default"], "`None` among every JAX peer": ["default", *others],
              "torch alone": ["torch"], "torch beside `None` (one process)": ["torch", "default"]}
  cases = {label: ",".join(systems) for label, systems in settings.items()}
  reports = timing.isolated("experiments.bench.attention", list(cases.values()),
                            turns=args.alternations, extra_args=_worker_args(d, n, causal, args))
  times = {}  # each setting's first system, in that setting's processes
  for label, systems in settings.items():
    for report in reports[cases[label]]:
      _extend(times, label, *report[systems[0]])
  ms = {label: [1e3 * statistics.median(t) for t in pair] for label, pair in times.items()}
  alone = {"default": ms["`None` alone"], "torch": ms["torch alone"]}
  lines = [f"D={d}, N={n}, B={max(1, args.tokens // n)}, {'causal' if causal else 'non-causal'};"
           f" {args.alternations} turns of {args.rounds} rounds (the four processes in turn, their"
           " order reversed every other turn), medians.", "",
           "| setting | ms fwd / fwd+bwd | time / alone, fwd / fwd+bwd |", "|---|---|---|"]
  for label, (fwd, fwd_bwd) in ms.items():
    base = alone["torch" if label.startswith("torch") else "default"]
    lines.append(f"| {label} | {fwd:.1f} / {fwd_bwd:.1f} | {fwd / base[0]:.2f} / "
                 f"{fwd_bwd / base[1]:.2f} |")
  return lines


def layout(grid, args) -> list[str]:
  """Markdown: `None`, the head-major plain graph and torch at each shape of `grid`."""
  systems = ["default", HEAD_MAJOR] + (["torch"] if has_torch(args.device) else [])
  lines = [f"{args.alternations} turns of {args.rounds} rounds, each system in its own process, "
           "medians; ms forward / forward+backward.", "",
           "| D | N | B | `None` (API layout) | plain graph on [B, H, N, D] | torch SDPA | "
           "`None` / plain graph | plain graph / torch |", "|---|---|---|---|---|---|---|---|"]
  for d, n, causal in grid:
    times = _alternate(d, n, causal, [[name] for name in systems], args)
    ms = {name: [1e3 * statistics.median(t) for t in pair] for name, pair in times.items()}
    cell = lambda name: "{:.1f} / {:.1f}".format(*ms[name]) if name in ms else "—"
    ratio = lambda a, b: ("{:.2f} / {:.2f}".format(*(x / y for x, y in zip(ms[a], ms[b])))
                          if a in ms and b in ms else "—")
    lines.append(f"| {d} | {n} | {max(1, args.tokens // n)} | {cell('default')} | "
                 f"{cell(HEAD_MAJOR)} | {cell('torch')} | {ratio('default', HEAD_MAJOR)} | "
                 f"{ratio(HEAD_MAJOR, 'torch')} |")
    print(lines[-1], flush=True)
  return lines


def temp_bytes(fn, n, h, d=64):
  """XLA temp bytes of jit(grad(sum(attention))) at [1, n, h, d], float32, causal (compile only)."""
  x = jax.ShapeDtypeStruct((1, n, h, d), jnp.float32)
  loss = lambda q, k, v: jnp.sum(fn(q, k, v, None, None, is_causal=True, scale=d**-0.5,
                                    dropout_rate=0.0, dropout_rng=None))
  return timing.grad_memory(loss, x, x, x).temp_size_in_bytes


def memory(sizes, cap):
  """Temp bytes at each (N, H) of `sizes`, and the largest N (H=8) within 20 GiB, searched by
  doubling from the first N up to `cap` (compile time grows with N: the search stops there)."""
  impls = {"chunked": chunked.attention, "rows": rows_lib.attention, "xla": xla.attention}
  rows = []
  for n, h in sizes:
    for name, fn in impls.items():
      if name == "xla" and n * n * h * 4 > 64 * GIB:
        continue
      rows.append(dict(impl=name, N=n, H=h, temp_gib=temp_bytes(fn, n, h) / GIB))
  largest = {}
  for name, fn in impls.items():  # doubling N at H=8 until the temp bytes pass 20 GiB
    if name == "rows":
      continue  # None runs rows up to dispatch.ROWS_MAX_KEYS keys: the table shows it
    n = sizes[0][0]
    while n < cap and temp_bytes(fn, n * 2, 8) <= 20 * GIB:
      n *= 2
    largest[name] = f">= {n}" if n == cap else str(n)
  return rows, largest


# Run size -> (speed grid of (D, N, causal); memory sizes (N, H); the cap of the largest-N
# search; timed rounds per turn; turns of the JAX and torch processes).
SIZES = {
    "full": ([(d, n, c) for d in (64, 128) for n in (64, 128, 256, 512, 1024, 2048, 4096, 8192)
              for c in (False, True)],
             [(1024, 8), (4096, 8), (8192, 8), (32768, 8), (131072, 1)], 2**20, 4, 2),
    "quick": ([(64, n, c) for n in (128, 512) for c in (False, True)],
              [(1024, 8), (4096, 8)], 2**18, 4, 2),
    "smoke": ([(16, 64, True)], [(128, 2)], 256, 1, 1),
}
PROTOCOL_CASE = (64, 512, False)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  size = parser.add_mutually_exclusive_group()
  size.add_argument("--quick", action="store_true", help="small grid, a few minutes")
  size.add_argument("--smoke", action="store_true",
                    help="tiny shapes, one round: that the command runs, no figures")
  parser.add_argument("--device", choices=("cpu", "gpu", "tpu"), default="cpu")
  parser.add_argument("--dtype", default=None,
                      help="float32 on CPU, bfloat16 on GPU and TPU by default")
  parser.add_argument("--tokens", type=int, default=4096,
                      help="B·N (B = max(1, tokens // N)); a GPU needs e.g. 65536 to be busy")
  parser.add_argument("--part", choices=("all", "speed", "memory", "protocol", "layout"),
                      default="all", help="speed, memory (CPU), both (all), the protocol's "
                      "check, or what the API layout costs at small N")
  parser.add_argument("--rounds", type=int, default=None, help="timed rounds per turn")
  parser.add_argument("--alternations", type=int, default=None,
                      help="turns of the JAX and torch processes per shape")
  parser.add_argument("--json", default=None,
                      help="also write all rows as JSON here (a temporary file under --smoke)")
  parser.add_argument("--ds", default=None,
                      help="these D in place of the grid's, e.g. 64,128 (ignored by --smoke)")
  parser.add_argument("--ns", default=None,
                      help="these N in place of the grid's, e.g. 16384 (ignored by --smoke)")
  parser.add_argument("--from-json", nargs="+", default=None,
                      help="time nothing: write the report of the speed rows in these files")
  parser.add_argument("--out", default=None, help="markdown path (default docs/benchmark_<dev>.md)")
  parser.add_argument("--time-case", default=None, help=argparse.SUPPRESS)  # "system,..."
  parser.add_argument("--shape", default=None, help=argparse.SUPPRESS)  # "D,N,causal"
  args = parser.parse_args()
  args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
  size = "smoke" if args.smoke else "quick" if args.quick else "full"
  grid, mem_sizes, cap, rounds, alternations = SIZES[size]
  args.rounds = args.rounds or rounds
  args.alternations = args.alternations or alternations
  if args.part == "protocol" and not has_torch(args.device):
    parser.error("--part protocol times torch beside JAX: it needs torch (pip install torch)")
  if args.time_case:
    d, n, causal = map(int, args.shape.split(","))
    print(json.dumps(time_case(d, n, bool(causal), args.time_case.split(","),
                               dtype=jnp.dtype(args.dtype), device=args.device,
                               rounds=args.rounds, tokens=args.tokens)))
    return
  if args.smoke:  # every step runs, but no report of the repository is overwritten
    args.out = os.path.join(tempfile.mkdtemp(), "smoke.md")
    args.json = args.json and os.path.join(os.path.dirname(args.out), "smoke.json")
  axes = [sorted({case[i] for case in grid}) for i in range(3)]  # the grid's D, N and causal
  for i, values in ((0, args.ds), (1, args.ns)):
    if values is not None and not args.smoke:  # a smoke run keeps its tiny shape
      axes[i] = [int(x) for x in values.split(",")]
  grid = [(d, n, c) for d in axes[0] for n in axes[1] for c in axes[2]]
  if args.part == "layout":
    grid = grid if args.smoke else [(d, n, c) for d, n, c in grid if n <= 512 and not c]
    text = "\n".join(["# What the [B, N, H, D] layout costs at small N", "",
                      "`python -m experiments.bench.attention --part layout` (see its "
                      "docstring).", "", *layout(grid, args), ""])
    write(args.out or "docs/benchmark_cpu_layout.md", text)
    return
  if args.from_json:
    speed_rows = [row for path in args.from_json for row in json.load(open(path))["speed"]]
  else:
    speed_rows = speed(grid, args) if args.part in ("all", "speed") else []
  mem_rows, largest = (memory(mem_sizes, cap)
                       if args.device == "cpu" and args.part in ("all", "memory") else ([], {}))
  out = args.out or f"docs/benchmark_{args.device}.md"
  if args.part == "protocol":
    text = "\n".join(["# The benchmark protocol's check", "",
                      "`python -m experiments.bench.attention --part protocol` (see its "
                      "docstring).", "",
                      *protocol(grid[0] if args.smoke else PROTOCOL_CASE, args), ""])
  else:
    text = markdown(speed_rows, mem_rows, largest, args.device, args.dtype)
  write(out, text)
  if speed_rows:
    plot(speed_rows, out[:-3] + ".png", args.device)
  if args.json:
    write_json(args.json, speed_rows, mem_rows, largest)


if __name__ == "__main__":
  main()
