"""The `python -m experiments.` commands that README.md, docs/*.md and flax_mha's comments cite,
which tests/test_bench_integration.py runs: read from those files (a newly cited one is covered
without touching either file), one per smoke run, every benchmark module cited; and what the
benchmarks compute beside the timing (collective bytes, the layout part, the GPU and TPU peers).

A command with a placeholder (`configs/<name>.py`) is not one to run. Modules in
TESTED_ELSEWHERE need more than a smoke run can make up (a trained workdir) and have their own
test.
"""

from __future__ import annotations

import pathlib
import re

import jax
import pytest

from experiments.bench import hlo_bytes

REPO = pathlib.Path(__file__).resolve().parent.parent
CITING = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")),
          *sorted(str(p.relative_to(REPO)) for p in (REPO / "flax_mha").rglob("*.py"))]
# Cited commands that need what a smoke run cannot make up, tested by their own test instead.
TESTED_ELSEWHERE = {
    "experiments.generate":
        "a trained workdir: tests/test_generate_command_integration.py trains one and runs it",
    "experiments.launch":
        "several processes training: tests/test_multiprocess_integration.py runs it",
    "experiments.serve":
        "a trained workdir and a server that runs until a signal: "
        "tests/serving/test_http_lm_integration.py trains one and serves it",
}
# Options (each with a value) that a module's --smoke run ignores, as its --help says.
SMOKE_IGNORES = {"experiments.bench.attention": ("--ds", "--ns", "--json"),
                 "experiments.bench.modules": ("--ns", "--turns", "--rounds")}


def _code_spans(name: str, text: str) -> list[str]:
  """Fenced blocks (continued lines joined) and inline `code` spans, whitespace folded; in
  Python files, spans within one line (a stray backtick then spoils one line, not the file)."""
  if name.endswith(".py"):
    spans = [span for line in text.splitlines() for span in re.findall(r"`([^`]+)`", line)]
  else:
    spans = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S):
      spans += block.replace("\\\n", " ").splitlines()
    spans += re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
  return [" ".join(span.split()) for span in spans]


def cited_commands() -> list[str]:
  """Each `python -m experiments.` command cited, from its first word (an environment
  variable's, if any) to its end; one of those that run the same smoke test (`_smoke_key`)."""
  commands = []
  for name in CITING:
    for span in _code_spans(name, (REPO / name).read_text()):
      words = span.replace(".venv/bin/python", "python").split() + [""]
      for i in range(len(words) - 2):
        if words[i:i + 2] == ["python", "-m"] and re.fullmatch(r"experiments(\.\w+)+",
                                                               words[i + 2]):
          env = [w for w in words[:i] if re.fullmatch(r"[A-Z_]+=\S+", w)]
          command = " ".join(env + words[i:-1])
          if "<" not in command and _smoke_key(command) not in map(_smoke_key, commands):
            commands.append(command)
  return commands


def _smoke_key(command: str) -> str:
  """What a command runs as a smoke test: --quick makes no difference there, nor --out (a smoke
  run writes no report of the repository's) or the options SMOKE_IGNORES names."""
  words = command.split()
  ignored = {"--out", *SMOKE_IGNORES.get(_module(command), ())}
  kept = [w for before, w in zip([""] + words, words) if w not in ignored and before not in ignored]
  return " ".join(w for w in kept if w != "--quick")


def _module(command: str) -> str:
  """The module a cited command runs."""
  return command.split("python -m ")[1].split()[0]


COMMANDS = cited_commands()
MODULES = sorted({_module(c) for c in COMMANDS} - set(TESTED_ELSEWHERE))


def test_every_benchmark_is_cited():
  """Each module of experiments/bench (but the timing, HLO and report helpers, and the parts
  a cited command runs) has a cited command."""
  bench = {f"experiments.bench.{p.stem}" for p in (REPO / "experiments" / "bench").glob("*.py")}
  helpers = {"experiments.bench.__init__", "experiments.bench.timing",
             "experiments.bench.hlo_bytes", "experiments.bench.attention_report",
             "experiments.bench.serving_parts", "experiments.bench.module_pieces",
             "experiments.bench.module_cases", "experiments.bench.static_batching",
             "experiments.bench.http_load"}
  missing = bench - helpers - set(MODULES)
  assert not missing, f"no command cited in README.md, docs/ or flax_mha/: {sorted(missing)}"


def test_collective_bytes_reads_replica_groups():
  """What a device receives: a permute all of its result, an all-gather over groups of 4 3/4,
  an all-reduce over groups of one (XLA leaves them in gradients) nothing; loops by trips."""
  hlo = "\n".join([
      "%body (p: f32[4]) -> f32[4] {",
      "  %c = f32[4]{0} collective-permute(%p), channel_id=3, source_target_pairs={{0,1},{1,0}}",
      "}",
      "ENTRY %main (p: f32[4]) -> f32[8] {",
      "  %a = f32[4]{0} all-reduce(%p), channel_id=1, replica_groups={{0},{1}}, to_apply=%sum",
      "  %b = f32[8]{0} all-gather(%a), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}",
      '  %w = f32[4]{0} while(%a), body=%body, backend_config={"known_trip_count":{"n":"3"}}',
      "}"])
  assert hlo_bytes.collective_bytes(hlo, 8) == 3 * 16 + 32 * 3 / 4


@pytest.mark.parametrize("causal", [False, True])
def test_layout_part_times_the_same_attention(causal):
  """--part layout's head-major plain graph, given the inputs transposed, is `None`'s attention
  transposed: the two columns it compares compute the same thing."""
  from experiments.bench import attention as bench  # pylint: disable=import-outside-toplevel
  import flax_mha  # pylint: disable=import-outside-toplevel
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (2, 16, 4, 8)) for key in keys)
  ours = flax_mha.dot_product_attention(q, k, v, is_causal=causal)
  theirs = bench._head_major_plain(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)), causal)
  assert jax.numpy.allclose(theirs.transpose(0, 2, 1, 3), ours, atol=1e-5)


def test_tpu_device_times_splash_beside_jax_nn_and_tokamax():
  """--device tpu (untimed here: no TPU) times None, splash and chunked beside jax.nn and
  tokamax's TPU kernels, no torch, in bfloat16; each JAX system computes None's attention."""
  from experiments.bench import attention as bench  # pylint: disable=import-outside-toplevel
  peers = bench._jax_peers("tpu")
  assert {"default", "splash", "chunked", "jax.nn xla"} <= set(peers)
  assert {"tokamax mosaic", "tokamax xla"} <= set(peers)  # tokamax is a test dependency
  assert not bench.has_torch("tpu") and not bench._skip("jax.nn xla", 8192, "tpu")
  keys = jax.random.split(jax.random.key(1), 3)
  q, k, v = (jax.random.normal(key, (1, 16, 2, 8)) for key in keys)
  want = peers["default"](q, k, v, True)
  for name in ("chunked", "jax.nn xla"):
    assert jax.numpy.allclose(peers[name](q, k, v, True), want, atol=1e-5), name


def test_gpu_device_times_cudnn_and_triton_beside_jax_nn_and_tokamax():
  """--device gpu (untimed here: no GPU) times None, cudnn, triton and chunked beside jax.nn's
  and tokamax's kernels; triton (in interpret mode here) computes None's attention."""
  from experiments.bench import attention as bench  # pylint: disable=import-outside-toplevel
  import flax_mha  # pylint: disable=import-outside-toplevel
  from flax_mha.kernels import triton  # pylint: disable=import-outside-toplevel
  peers = bench._jax_peers("gpu")
  assert {"default", "cudnn", "triton", "chunked", "jax.nn xla", "jax.nn cudnn"} <= set(peers)
  assert {"tokamax triton", "tokamax xla"} <= set(peers)
  keys = jax.random.split(jax.random.key(1), 3)
  q, k, v = (jax.random.normal(key, (1, 16, 2, 8)) for key in keys)
  interpreted = flax_mha.dot_product_attention(q, k, v, is_causal=True,
                                               implementation=triton.make_attention(
                                                   interpret=True))
  assert jax.numpy.allclose(interpreted, peers["default"](q, k, v, True), atol=1e-5)


def test_http_load_records_and_summary():
  """experiments.bench.http_load: a request's TTFT and TPOT from its chunks' times, a token
  chunk told from the finish and usage chunks, and the summary's throughput and percentiles
  (NumPy's) over the completed requests; a short or failed request counts as failed."""
  from experiments.bench import http_load  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  one = http_load.record(sent=1.0, times=[1.5, 2.0, 3.5], tokens=5, start=0.5)
  assert (one["ttft"], one["tpot"], one["end"]) == (0.5, 0.5, 3.0)
  two = http_load.record(sent=2.0, times=[2.25, 4.25], tokens=5, start=0.5)
  short = http_load.record(sent=2.0, times=[3.0], tokens=1, start=0.5)
  failed = http_load.record(sent=2.0, times=[], tokens=0, start=0.5, error="HTTP 500")
  out = http_load.summary([one, two, short, failed], new=5)
  assert (out["completed"], out["failed"]) == (2, 2)
  assert out["errors"] == ["1 tokens", "HTTP 500"]
  assert out["throughput"] == 10 / 3.75  # the last token 3.75 s after the run's start
  assert np.allclose(out["ttft"], (375, np.percentile([500, 250], 99)))
  assert np.allclose(out["tpot"], (500, np.percentile([500, 500], 99)))
  chunk = lambda text, finish=None: {"choices": [{"text": text, "finish_reason": finish}]}
  assert http_load._token_chunk(chunk(" ba")) and http_load._token_chunk(chunk(" ba", "length"))
  assert not http_load._token_chunk(chunk("", "length"))
  assert not http_load._token_chunk({"choices": [], "usage": {"completion_tokens": 5}})
  assert http_load._token_chunk({"choices": [{"delta": {"content": "x"}, "finish_reason": None}]})
  times = http_load.arrivals(2000, rate=4.0, seed=3)
  assert times == http_load.arrivals(2000, rate=4.0, seed=3) and times[0] == 0.0
  assert abs(np.mean(np.diff(times)) - 0.25) < 0.02
  assert http_load.arrivals(3, rate=float("inf"), seed=0) == [0.0] * 3
