"""A Hugging Face checkpoint generating: flax_mha against transformers, on the CPU.

  python -m experiments.bench.hf                    # -> docs/benchmark_hf_cpu.md
  python -m experiments.bench.hf --smoke            # seconds: a tiny model, nothing written

A Llama-shaped model of 124M parameters (D=768, 12 layers, 12 query heads and 4 key/value
heads of 64, MLP 2048, vocabulary 32000, untied embeddings) with random weights, saved once by
transformers as a float32 safetensors checkpoint in a scratch directory. Each case generates 128
new tokens greedily after a prompt of 128 random tokens, at batch 1 and 8, in float32 and
bfloat16:
- flax_mha: `flax_mha.models.hf.load` (in the dtype asked), then `decoding.generate` (one
  compiled prefill and loop);
- transformers: `AutoModelForCausalLM.from_pretrained` (eager attention is what the parity tests
  use; here "sdpa", its fastest on CPU) and `generate` with its static cache
  (`cache_implementation="static"`), end-of-sequence off on both sides.
Each case runs in a process of its own, the processes taking turns (experiments.bench.timing);
a worker generates once untimed (compilation, warm-up), then times `rounds` generations.
Tokens/s is the new tokens over the median seconds of a whole `generate` (prefill included).
Peak memory is the worker's peak resident set (ru_maxrss), weights, compilation and caches
included. "same tokens" says whether batch row 0's float32 tokens equal the other side's.

`--part load` measures the loader alone, in a process of its own: the peak resident set during
the load over the resident set just before it (the runtime started), against the checkpoint's
bytes: no second full copy of the weights.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import sys
import tempfile

import numpy as np

from experiments.bench import timing

MODEL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
             num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
             tie_word_embeddings=False)
SMOKE_MODEL = dict(MODEL, vocab_size=256, hidden_size=64, intermediate_size=96,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
SYSTEMS = ("flax_mha", "transformers")
DTYPES = ("float32", "bfloat16")
PROMPT, NEW = 128, 128


def make_checkpoint(directory: pathlib.Path, smoke: bool) -> pathlib.Path:
  """The random Llama checkpoint (float32 safetensors), made by transformers once."""
  if (directory / "model.safetensors").is_file():  # written after config.json
    return directory
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  config = transformers.LlamaConfig(**(SMOKE_MODEL if smoke else MODEL), pad_token_id=0,
                                    bos_token_id=1, eos_token_id=2)
  transformers.LlamaForCausalLM(config).save_pretrained(directory)
  return directory


def _prompts(batch: int, vocab: int) -> np.ndarray:
  return np.random.default_rng(0).integers(3, vocab, (batch, PROMPT)).astype(np.int32)


def _peak_mib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _resident_mib() -> float:
  """The resident set now (Linux: /proc/self/status)."""
  with open("/proc/self/status") as f:
    kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
  return kib / 1024


def _timed(run, rounds: int) -> dict:
  """A worker's report: `run()` once untimed (its tokens: row 0's), then `rounds` timed."""
  tokens, seconds = timing.once_then_timed(run, rounds)
  return dict(seconds=seconds, tokens=[int(t) for t in tokens[0]], peak_mib=_peak_mib())


def _time_flax(directory, dtype: str, batch: int, rounds: int, new: int) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  from flax_mha.models import decoding, hf  # pylint: disable=import-outside-toplevel
  model, variables = hf.load(directory, dtype=dtype)
  prompts = _prompts(batch, model.config.vocab_size)
  run = lambda: np.asarray(jax.block_until_ready(decoding.generate(
      model, variables, (prompts,), prompts, max_new_tokens=new)))
  return _timed(run, rounds)  # the first run compiles


def _time_transformers(directory, dtype: str, batch: int, rounds: int, new: int) -> dict:
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  model = transformers.AutoModelForCausalLM.from_pretrained(
      directory, dtype=getattr(torch, dtype), attn_implementation="sdpa").eval()
  prompts = torch.from_numpy(_prompts(batch, model.config.vocab_size).astype(np.int64))
  config = model.generation_config
  config.update(eos_token_id=None, pad_token_id=0, max_new_tokens=new, do_sample=False,
                num_beams=1, cache_implementation="static")

  def run():
    with torch.no_grad():
      return model.generate(prompts, attention_mask=torch.ones_like(prompts),
                            generation_config=config)[:, PROMPT:]
  return _timed(run, rounds)  # the first run allocates the static cache


def _time_load(directory) -> dict:
  """The resident set a load adds (peak minus before), and the checkpoint's bytes."""
  import jax  # pylint: disable=import-outside-toplevel
  from flax_mha.models import hf  # pylint: disable=import-outside-toplevel
  jax.block_until_ready(jax.numpy.zeros(1))  # the runtime up before the baseline
  before = _resident_mib()  # now, not the peak so far: the added peak is not understated
  _, variables = hf.load(directory)
  jax.block_until_ready(variables)
  size = sum(p.stat().st_size for p in hf.tensor_files(directory)) / 2 ** 20
  return dict(checkpoint_mib=size, added_mib=_peak_mib() - before)


def _cases() -> list[str]:
  return [f"{s}:{d}:{b}" for d in DTYPES for b in (1, 8) for s in SYSTEMS]


def generation(directory, rounds: int, turns: int, new: int, extra: list[str]) -> list[str]:
  reports = timing.isolated("experiments.bench.hf", _cases(), turns=turns,
                            extra_args=["--checkpoint", str(directory), *extra])
  rows = ["| dtype | batch | flax_mha tokens/s | transformers tokens/s | ratio | flax_mha peak "
          "MiB | transformers peak MiB | same tokens |", "|---|---|---|---|---|---|---|---|"]
  for dtype in DTYPES:
    for batch in (1, 8):
      ours, theirs = (reports[f"{s}:{dtype}:{batch}"] for s in SYSTEMS)
      speed = [batch * new / statistics.median([t for r in rs for t in r["seconds"]])
               for rs in (ours, theirs)]
      peak = [max(r["peak_mib"] for r in rs) for rs in (ours, theirs)]
      same = "yes" if ours[0]["tokens"] == theirs[0]["tokens"] else "no"
      rows.append(f"| {dtype} | {batch} | {speed[0]:.1f} | {speed[1]:.1f} | "
                  f"**{speed[0] / speed[1]:.2f}x** | {peak[0]:.0f} | {peak[1]:.0f} | {same} |")
  return rows


def load(directory, extra: list[str]) -> list[str]:
  lines = timing.run_worker([sys.executable, "-m", "experiments.bench.hf", "--time-case",
                             "load", "--checkpoint", str(directory), *extra])
  report = json.loads(lines[-1])
  return ["| checkpoint MiB | resident set added by the load, MiB | ratio |", "|---|---|---|",
          f"| {report['checkpoint_mib']:.0f} | {report['added_mib']:.0f} | "
          f"{report['added_mib'] / report['checkpoint_mib']:.2f} |"]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", action="append", choices=("generation", "load"))
  parser.add_argument("--smoke", action="store_true", help="a tiny model, nothing written")
  parser.add_argument("--out", default="docs/benchmark_hf_cpu.md")
  parser.add_argument("--checkpoint", default=None, help="the model's directory (default: a "
                      "scratch one, made by transformers)")
  parser.add_argument("--time-case", default=None, help=argparse.SUPPRESS)  # a worker's case
  args = parser.parse_args()
  rounds, turns, new = (1, 1, 4) if args.smoke else (2, 2, NEW)
  if args.time_case:
    if args.time_case == "load":
      print(json.dumps(_time_load(args.checkpoint)))
      return
    system, dtype, batch = args.time_case.split(":")
    timer = _time_flax if system == "flax_mha" else _time_transformers
    print(json.dumps(timer(args.checkpoint, dtype, int(batch), rounds, new)))
    return
  scratch = (tempfile.mkdtemp(prefix="flax_mha_bench_") if args.smoke else
             os.path.join(tempfile.gettempdir(), "flax_mha_bench_llama"))  # kept: 0.5 GB
  directory = pathlib.Path(args.checkpoint or scratch)
  make_checkpoint(directory, args.smoke)
  extra = ["--smoke"] if args.smoke else []
  sections = {"generation": lambda: generation(directory, rounds, turns, new, extra),
              "load": lambda: load(directory, extra)}
  timing.write_report("A Hugging Face checkpoint generating (CPU)",
                      "python -m experiments.bench.hf", args.part or ["generation", "load"],
                      sections, args.out, args.smoke)


if __name__ == "__main__":
  main()
