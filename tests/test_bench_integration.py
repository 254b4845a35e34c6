"""Every `python -m experiments.` command that README.md, docs/*.md and flax_mha's comments cite
runs, so a cited command cannot rot unnoticed. How the commands are found is the unit part,
tests/test_bench.py.

A benchmark runs with --smoke (tiny shapes, one round, no figures) in place of --quick, on a
config's tiny variant; a training run on the tiny variant for 2 steps. Each runs in a subprocess
in a scratch directory, so what a command writes (docs/benchmark_cpu.md, runs/...) lands there,
never in the repository; the runs share a jax compilation cache. A GPU command is skipped where
jax sees no GPU.

Commands of SLOW_MODULES are marked slow (`make test-slow`), each for its reason:
- experiments.train, bench.training, bench.nnx compile whole training steps (15-30 s each on the
  2-core machine); tests/test_train_integration.py trains the same runner in every run;
- bench.speculative trains two tiny LMs and starts 7 workers (JAX or torch each), minutes on a
  loaded machine; the exporter it relies on is tested below, against transformers' logits;
- bench.attention, sparsity, generation, ring, hf, decode, blocks and fsdp took 60-290 s each
  (20 of the integration part's 57 minutes on the slower machine type, 2026-11-28), and
  serving_speed 131 s (a checkpoint made by transformers, three worker processes): what they
  time is tested where it is built (the kernels against the oracle, generation and serving
  against recompute, the ring and FSDP on 8 devices, the loader against transformers), and
  their argument parsing and report writing by the cheaper commands that stay;
- bench.http_serving starts three servers and a worker, each importing jax or torch (70 s on the
  slower machine type): the HTTP server has its own end-to-end tests;
- bench.bf16_cpu starts a worker per product form (37 s): the forms it times, and what the
  compiled programs hold, are tested in tests/test_precision.py;
- bench.latent_moe makes two checkpoints with transformers and starts nine workers: the models
  it times are tested against transformers in tests/models/test_hf_integration.py, and its
  table rows are bench.hf's.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_bench import COMMANDS, MODULES, REPO

pytestmark = pytest.mark.integration  # subprocesses, one a module

SLOW_MODULES = ("experiments.train", "experiments.bench.training", "experiments.bench.nnx",
                "experiments.bench.attention", "experiments.bench.sparsity",
                "experiments.bench.generation", "experiments.bench.ring", "experiments.bench.hf",
                "experiments.bench.decode", "experiments.bench.blocks", "experiments.bench.fsdp",
                "experiments.bench.http_serving", "experiments.bench.speculative",
                "experiments.bench.serving_speed", "experiments.bench.bf16_cpu",
                "experiments.bench.latent_moe")
TRAIN_SMOKE = ["--config.train.steps=2", "--config.train.log_every=1",
               "--config.train.checkpoint_every=2", "--config.eval.every=2",
               "--config.eval.num_examples=4", "--config.eval.batch_size=4"]


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


@pytest.mark.parametrize("module", [
    pytest.param(m, marks=[pytest.mark.slow] if m in SLOW_MODULES else [], id=m) for m in MODULES])
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


def test_exported_llama_gives_transformers_our_logits(tmp_path):
  """experiments.bench.speculative's `export_llama`: configs/lm_copy.py's tiny LM, random
  weights, written as a Llama checkpoint; transformers' own model on it gives our logits, and
  `flax_mha.models.hf.load` reads back our parameters."""
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  import hf_checkpoints as hc  # pylint: disable=import-outside-toplevel
  from configs import lm_copy  # pylint: disable=import-outside-toplevel
  from experiments import lm, tasks  # pylint: disable=import-outside-toplevel
  from experiments.bench import speculative  # pylint: disable=import-outside-toplevel
  from flax_mha.models import hf  # pylint: disable=import-outside-toplevel
  config = lm_copy.get_config("tiny")
  cfg = lm.model_config(config, tasks.get_task("copy", **config.task.kwargs))
  model = lm.DecoderLM(cfg)
  tokens = np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 11)).astype(np.int32)
  params = model.init(jax.random.key(1), jnp.asarray(tokens))["params"]
  directory = speculative.export_llama(cfg, params, tmp_path / "llama")
  ours = np.asarray(model.apply({"params": params}, jnp.asarray(tokens)))
  positions = np.broadcast_to(np.arange(11), tokens.shape)
  theirs = hc.hf_logits(directory, tokens, np.ones_like(tokens), positions)
  np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
  _, back = hf.load(directory)
  jax.tree.map(np.testing.assert_array_equal, back["params"], params)
