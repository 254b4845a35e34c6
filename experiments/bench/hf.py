"""A Hugging Face checkpoint generating: flax_mha against transformers, on the CPU.

  python -m experiments.bench.hf                    # -> docs/benchmark_hf_cpu.md
  python -m experiments.bench.hf --smoke            # seconds: a tiny model, nothing written

A Llama-shaped model of 124M parameters (D=768, 12 layers, 12 query heads and 4 key/value
heads of 64, MLP 2048, vocabulary 32000, untied embeddings) with random weights, saved once by
transformers as a float32 safetensors checkpoint in a scratch directory. Each case generates 128
new tokens greedily after a prompt of 128 random tokens, at batch 1, 8 and 32, in float32 and
bfloat16 (the checkpoint loaded in that dtype on both sides: a bfloat16 checkpoint's weights):
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

`--part numerics` compares, on the checkpoint saved in bfloat16 (its weights rounded once), the
logits of 4 prompts of 128 random tokens: flax_mha's bfloat16 and float32 (the same bfloat16
weights computed in float32) against transformers' bfloat16 and float32 (eager attention): the
largest absolute difference over all positions, as a share of the largest float32 logit, and
how often the argmax agrees. `--part hlo` counts, in flax_mha's compiled `generate` of each
dtype and batch, the converts and products inside the decoding loop, and the converts of a
weight's shape there and before it (`experiments.bench.hlo_bytes.converts`), beside what `flax_mha.precision.explain`
says the products do.
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

from experiments.bench import bf16_cpu
from experiments.bench import timing

MODEL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
             num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
             tie_word_embeddings=False)
SMOKE_MODEL = dict(MODEL, vocab_size=256, hidden_size=64, intermediate_size=96,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
SYSTEMS = ("flax_mha", "transformers")
DTYPES = ("float32", "bfloat16")
BATCHES = (1, 8, 32)
PROMPT, NEW = 128, 128
NUMERICS_ROWS = 4


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


def time_flax(directory, dtype: str, batch: int, rounds: int, new: int) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  from flax_mha.models import decoding, hf  # pylint: disable=import-outside-toplevel
  model, variables = hf.load(directory, dtype=dtype)
  prompts = _prompts(batch, model.config.vocab_size)
  run = lambda: np.asarray(jax.block_until_ready(decoding.generate(
      model, variables, (prompts,), prompts, max_new_tokens=new)))
  return _timed(run, rounds)  # the first run compiles


def time_transformers(directory, dtype: str, batch: int, rounds: int, new: int) -> dict:
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


def bf16_checkpoint(directory: pathlib.Path) -> pathlib.Path:
  """The checkpoint of `directory` saved again in bfloat16, beside it (made once)."""
  out = directory.with_name(directory.name + "_bf16")
  if (out / "model.safetensors").is_file():
    return out
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
  model.save_pretrained(out)
  return out


def _numerics(directory) -> dict:
  """Logits of the bfloat16 checkpoint in `directory`: each side in bfloat16 and float32."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from flax_mha.models import hf  # pylint: disable=import-outside-toplevel
  logits = {}
  for dtype in DTYPES:
    model, variables = hf.load(directory, dtype=dtype)
    tokens = _prompts(NUMERICS_ROWS, model.config.vocab_size)
    logits[f"flax_mha {dtype}"] = np.asarray(model.apply(variables, jnp.asarray(tokens)))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=getattr(torch, dtype), attn_implementation="eager").eval()
    with torch.no_grad():
      out = theirs(input_ids=torch.from_numpy(tokens.astype(np.int64)), use_cache=False)
    logits[f"transformers {dtype}"] = out.logits.float().numpy()
  scale = float(np.abs(logits["transformers float32"]).max())
  pairs = [("flax_mha bfloat16", "transformers bfloat16"), ("flax_mha bfloat16", "flax_mha float32"),
           ("transformers bfloat16", "transformers float32"),
           ("flax_mha float32", "transformers float32")]
  return dict(scale=scale, pairs=[
      dict(a=a, b=b, max_abs=float(np.abs(logits[a] - logits[b]).max()),
           argmax=float((logits[a].argmax(-1) == logits[b].argmax(-1)).mean()))
      for a, b in pairs])


def _hlo(directory) -> list[dict]:
  """For each dtype and batch: flax_mha's compiled `generate`'s converts and products (loop
  and before it) and `precision.explain`'s sentence."""
  import jax  # pylint: disable=import-outside-toplevel
  from experiments.bench import hlo_bytes  # pylint: disable=import-outside-toplevel
  from flax_mha import precision  # pylint: disable=import-outside-toplevel
  from flax_mha.models import decoding, hf  # pylint: disable=import-outside-toplevel
  rows = []
  for dtype in DTYPES:
    model, variables = hf.load(directory, dtype=dtype)
    shapes = {p.shape for p in jax.tree.leaves(variables) if p.ndim >= 2}
    shapes |= {(s[0], int(np.prod(s[1:]))) for s in shapes} | {
        (int(np.prod(s[:-1])), s[-1]) for s in shapes}  # as XLA may flatten a kernel
    for batch in BATCHES:
      prompts = _prompts(batch, model.config.vocab_size)
      run = jax.jit(lambda v, p: decoding.generate(model, v, (p,), p, max_new_tokens=NEW))
      text = run.lower(variables, prompts).compile().as_text()
      rows.append(dict(dtype=dtype, batch=batch, explain=precision.explain(
          dtype, batch, jax.default_backend()), **hlo_bytes.converts(text, shapes)))
  return rows


def _cases() -> list[str]:
  return [f"{s}:{d}:{b}" for d in DTYPES for b in BATCHES for s in SYSTEMS]


def generation(directory, rounds: int, turns: int, new: int, extra: list[str]) -> list[str]:
  reports = timing.isolated("experiments.bench.hf", _cases(), turns=turns,
                            extra_args=["--checkpoint", str(directory), *extra])
  rows = ["| dtype | batch | flax_mha tokens/s | transformers tokens/s | ratio | flax_mha peak "
          "MiB | transformers peak MiB | same tokens |", "|---|---|---|---|---|---|---|---|"]
  for dtype in DTYPES:
    for batch in BATCHES:
      rows.append(comparison_row(dtype, batch, new, *(reports[f"{s}:{dtype}:{batch}"]
                                                      for s in SYSTEMS)))
  return rows


def comparison_row(label: str, batch: int, new: int, ours: list, theirs: list) -> str:
  """A table row of two systems' worker reports at one batch size: tokens/s of each (the new
  tokens over the median seconds of all their rounds), the ratio, peak MiB, same tokens."""
  speed = [batch * new / statistics.median([t for r in rs for t in r["seconds"]])
           for rs in (ours, theirs)]
  peak = [max(r["peak_mib"] for r in rs) for rs in (ours, theirs)]
  same = "yes" if ours[0]["tokens"] == theirs[0]["tokens"] else "no"
  return (f"| {label} | {batch} | {speed[0]:.1f} | {speed[1]:.1f} | "
          f"**{speed[0] / speed[1]:.2f}x** | {peak[0]:.0f} | {peak[1]:.0f} | {same} |")


def _worker(case: str, directory, extra: list[str]):
  """What the worker of `case` ('load', 'numerics', 'hlo') printed last, a process of its own."""
  lines = timing.run_worker([sys.executable, "-m", "experiments.bench.hf", "--time-case", case,
                             "--checkpoint", str(directory), *extra])
  return json.loads(lines[-1])


def numerics(directory, extra: list[str]) -> list[str]:
  report = _worker("numerics", bf16_checkpoint(directory), extra)
  rows = [f"Logits of {NUMERICS_ROWS} prompts of {PROMPT} tokens, the checkpoint saved in "
          f"bfloat16; the largest float32 logit: {report['scale']:.2f}.", "",
          "| logits | against | max abs difference | share of the largest logit | argmax agrees |",
          "|---|---|---|---|---|"]
  for p in report["pairs"]:
    rows.append(f"| {p['a']} | {p['b']} | {p['max_abs']:.3g} | "
                f"{p['max_abs'] / report['scale']:.2%} | {p['argmax']:.2%} |")
  return rows


def hlo(directory, extra: list[str]) -> list[str]:
  rows = ["| dtype | batch | converts of a weight's shape before the loop | in the loop | "
          "converts in the loop | YNNPACK fusions in the loop | dots XLA runs itself in the loop |",
          "|---|---|---|---|---|---|---|"]
  reports = _worker("hlo", directory, extra)
  for r in reports:
    rows.append(f"| {r['dtype']} | {r['batch']} | {r['shaped_converts']} | "
                f"{r['loop_shaped_converts']} | {r['loop_converts']} | {r['loop_ynn']} | "
                f"{r['loop_dots']} |")
  rows += ["", "What the products do (`flax_mha.precision.explain`):", ""]
  rows += [f"- {r['dtype']}, batch {r['batch']}: {r['explain']}" for r in reports]
  return rows


def load(directory, extra: list[str]) -> list[str]:
  report = _worker("load", directory, extra)
  return ["| checkpoint MiB | resident set added by the load, MiB | ratio |", "|---|---|---|",
          f"| {report['checkpoint_mib']:.0f} | {report['added_mib']:.0f} | "
          f"{report['added_mib'] / report['checkpoint_mib']:.2f} |"]


def worker(case: str, checkpoint, rounds: int, new: int):
  """A worker's report for `case`: 'load', 'numerics', 'hlo', or 'system:dtype:batch'."""
  special = {"load": _time_load, "numerics": _numerics, "hlo": _hlo}
  if case in special:
    return special[case](checkpoint)
  system, dtype, batch = case.split(":")
  timer = time_flax if system == "flax_mha" else time_transformers
  return timer(checkpoint, dtype, int(batch), rounds, new)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", action="append",
                      choices=("generation", "load", "numerics", "hlo"))
  parser.add_argument("--smoke", action="store_true", help="a tiny model, nothing written")
  parser.add_argument("--out", default="docs/benchmark_hf_cpu.md")
  parser.add_argument("--checkpoint", default=None, help="the model's directory (default: a "
                      "scratch one, made by transformers)")
  parser.add_argument("--time-case", default=None, help=argparse.SUPPRESS)  # a worker's case
  args = parser.parse_args()
  rounds, turns, new = (1, 1, 4) if args.smoke else (2, 2, NEW)
  if args.time_case:
    print(json.dumps(worker(args.time_case, args.checkpoint, rounds, new)))
    return
  scratch = (tempfile.mkdtemp(prefix="flax_mha_bench_") if args.smoke else
             os.path.join(tempfile.gettempdir(), "flax_mha_bench_llama"))  # kept: 0.5 GB
  directory = pathlib.Path(args.checkpoint or scratch)
  make_checkpoint(directory, args.smoke)
  extra = ["--smoke"] if args.smoke else []
  load_before = os.getloadavg()

  def timed_generation():  # the machine's lines after the run, for its load average
    rows = generation(directory, rounds, turns, new, extra)
    return bf16_cpu.machine(load_before) + rows
  sections = {"generation": timed_generation,
              "load": lambda: load(directory, extra),
              "numerics": lambda: numerics(directory, extra),
              "hlo": lambda: hlo(directory, extra)}
  timing.write_report("A Hugging Face checkpoint generating (CPU)",
                      "python -m experiments.bench.hf",
                      args.part or ["generation", "load", "numerics", "hlo"], sections, args.out,
                      args.smoke)


if __name__ == "__main__":
  main()
