"""Every `python -m experiments.` command that README.md, docs/*.md and flax_mha's comments cite
runs, so a cited command cannot rot unnoticed.

The commands are read from those files: a newly cited one is covered without touching this file.
A benchmark runs with --smoke (tiny shapes, one round, no figures) in place of --quick, on a
config's tiny variant; a training run on the tiny variant for 2 steps. Each runs in a subprocess
in a scratch directory, so what a command writes (docs/benchmark_cpu.md, runs/...) lands there,
never in the repository; the runs share a jax compilation cache. A command with a placeholder
(`configs/<name>.py`) is not one to run; a GPU command is skipped where jax sees no GPU.

Commands of SLOW_MODULES compile whole training steps (15-30 s each on the 2-core machine) and
are marked slow (`make test-slow`); tests/test_train.py trains the same runner in every run.
Modules in TESTED_ELSEWHERE need more than a smoke run can make up (a trained workdir) and have
their own test.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import jax
import pytest

from experiments.bench import hlo_bytes

REPO = pathlib.Path(__file__).resolve().parent.parent
CITING = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")),
          *sorted(str(p.relative_to(REPO)) for p in (REPO / "flax_mha").rglob("*.py"))]
SLOW_MODULES = ("experiments.train", "experiments.bench.training", "experiments.bench.nnx")
# Cited commands that need what a smoke run cannot make up, tested by their own test instead.
TESTED_ELSEWHERE = {
    "experiments.generate": "a trained workdir: tests/test_generate_command.py trains one and runs it",
    "experiments.launch": "several processes training: tests/test_multiprocess.py runs it",
}
# Options (each with a value) that a module's --smoke run ignores, as its --help says.
SMOKE_IGNORES = {"experiments.bench.attention": ("--ds", "--ns", "--json")}
TRAIN_SMOKE = ["--config.train.steps=2", "--config.train.log_every=1",
               "--config.train.checkpoint_every=2", "--config.eval.every=2",
               "--config.eval.num_examples=4", "--config.eval.batch_size=4"]


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


def _tiny(args: list[str], scratch: pathlib.Path) -> list[str]:
  """`--config configs/x.py[:arg]` -> the config's tiny variant (`:tiny`, `:arg,tiny`; a
  cited tiny one stays);
  `--workdir W` -> a folder of `scratch` named after W (commands citing one workdir share it,
  as a resumed run does; different ones do not)."""
  out = list(args)
  for i, word in enumerate(out[:-1]):
    if word == "--config":
      path, _, arg = out[i + 1].partition(":")
      if "tiny" not in arg.split(","):
        out[i + 1] = f"{path}:{arg},tiny" if arg else f"{path}:tiny"
    elif word == "--workdir":
      out[i + 1] = str(scratch / "runs" / re.sub(r"\W", "_", out[i + 1]))
  return out


def smoke_argv(command: str, scratch: pathlib.Path) -> tuple[dict, list[str]]:
  """(environment additions, argv) of the smoke run of `command`."""
  words = shlex.split(command)
  env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=\S+", w))
  words = words[len(env):]
  module, args = words[2], _tiny(words[3:], scratch)
  if module == "experiments.train":
    args += TRAIN_SMOKE
  else:
    args = [a for a in args if a != "--quick"] + ["--smoke"]
  return env, [sys.executable, "-m", module, *args]


COMMANDS = cited_commands()
MODULES = sorted({_module(c) for c in COMMANDS} - set(TESTED_ELSEWHERE))


def test_every_benchmark_is_cited():
  """Each module of experiments/bench (but the timing, HLO and report helpers) has a cited
  command."""
  bench = {f"experiments.bench.{p.stem}" for p in (REPO / "experiments" / "bench").glob("*.py")}
  helpers = {"experiments.bench.__init__", "experiments.bench.timing",
             "experiments.bench.hlo_bytes", "experiments.bench.attention_report"}
  missing = bench - helpers - set(MODULES)
  assert not missing, f"no command cited in README.md, docs/ or flax_mha/: {sorted(missing)}"


@pytest.mark.parametrize("module", [
    pytest.param(m, marks=[pytest.mark.slow] if m in SLOW_MODULES else [], id=m) for m in MODULES])
@pytest.mark.integration
def test_cited_commands_run(module, tmp_path):
  """The module's cited commands, one after the other: later ones reuse the programs the first
  compiled (a shared jax compilation cache)."""
  commands = [c for c in COMMANDS if f"python -m {module} " in f"{c} "]
  for device in ("gpu", "tpu"):  # an accelerator's commands wait for a machine with one
    if jax.default_backend() != device:
      commands = [c for c in commands if f"--device {device}" not in c]
  (tmp_path / "configs").symlink_to(REPO / "configs")  # the cited paths are the repository's
  for command in commands:
    extra_env, argv = smoke_argv(command, tmp_path)
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", **extra_env)
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"{command}\nran as {shlex.join(argv)}, failed:\n" + (
        result.stderr[-4000:])


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
