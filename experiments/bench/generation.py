"""Generation with the decoder-only LM (configs/lm.py's architecture), on the CPU, float32.

  python -m experiments.bench.generation                    # -> docs/generation_cpu.md
  python -m experiments.bench.generation --workdir runs/lm  # + the trained LM's evaluation
  python -m experiments.bench.generation --smoke            # seconds: tiny sizes, no file
                                    # (with --workdir and no run there: a tiny LM trained first)

Parts:
  cached     batch 8, prompt 64 + 448 new tokens, greedy: the KV-cache decoding
             (flax_mha.models.decoding.generate) against recomputing the whole prefix every
             step (experiments.lm.generate_by_recompute); tokens/s, and the tokens must agree.
  eval       with --workdir (a trained `configs/lm.py` run): the held-out evaluation's greedy
             answers by each path (the float32 cache, an int8 one, the prefix recomputed),
             their exact match, how many equal the float cache's, and seconds.
  serving    16 prompts of 16 to 2048 tokens (geometric, in order) asking 16 to 256 new tokens
             each: continuous batching over a paged cache (flax_mha.serving.serve, 4
             rows, pages of 16 tokens, its on-device loop with chunked prefill) against static
             batching (groups of 4 padded to their longest); tokens/s, and the cache's bytes:
             the pages in use at the peak against the tokens held then, and against 4 rows x
             the longest request. Then 12 prompts of 16 to 2048 tokens, shuffled, asking 16 to
             512 new tokens: lengths that differ within a static group.
  prefix     12 requests sharing a 1024-token prefix, each with its own tail, 64 new tokens:
             serve with prefix caching against without (configs/lm.py's model, all layers
             global); tokens/s, and the same tokens required.
  online     48 requests arriving as a Poisson process at 80% of the rows' capacity
             (a `serving.Server` with its own thread) against the same requests given up front:
             time to the first token and per output token, median and p99.
  int8       the first serving mix (all layers global) with the page pool in int8 against
             float32: the pool's bytes, tokens/s, and how many greedy tokens agree.
Each path runs once untimed (compilation), then the timed runs alternate; medians.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from configs import lm as lm_config
from experiments import lm
from experiments.bench import serving_parts
from experiments.bench import timing
from experiments.bench import static_batching
from flax_mha import serving
from flax_mha.models import decoding
from flax_mha.models.lm import DecoderLM, LMConfig


def _fields(smoke: bool) -> dict:
  return dict(lm_config.get_config("tiny" if smoke else None).model)


def _model(vocab: int, smoke: bool):
  model = DecoderLM(LMConfig(vocab_size=vocab, **_fields(smoke)))
  x = jnp.zeros((1, 8), jnp.int32)
  return model, model.init(jax.random.key(0), x, x, x)


def cached(batch: int, prompt: int, new: int, runs: int, smoke: bool) -> list[str]:
  vocab = 64
  model, params = _model(vocab, smoke)
  prompts = np.random.default_rng(0).integers(3, vocab, (batch, prompt)).astype(np.int32)
  lengths = np.full(batch, prompt, np.int32)
  room = np.zeros((batch, prompt + new), np.int32)
  room[:, :prompt] = prompts
  fns = {"KV cache (decoding.generate)": lambda: np.asarray(decoding.generate(
             model, params, (prompts,), prompts, lengths, max_new_tokens=new)),
         "prefix recomputed each step": lambda: np.asarray(lm.generate_by_recompute(
             model, params["params"], room, lengths, new))[:, prompt:]}
  out = timing.in_turns(fns, runs)
  (t_cache, tok_cache), (t_full, tok_full) = out.values()
  assert np.array_equal(tok_cache, tok_full), "cached and recomputed greedy tokens differ"
  rate = lambda t: batch * new / t
  return ["| path | seconds (median) | tokens/s | speed-up |", "|---|---|---|---|",
          f"| KV cache | {t_cache:.2f} | {rate(t_cache):.0f} | {t_full / t_cache:.1f}x |",
          f"| prefix recomputed | {t_full:.2f} | {rate(t_full):.0f} | 1.0x |",
          "", f"Greedy tokens identical: {tok_cache.size} of {tok_full.size}."]


def _tiny_run(workdir: str) -> None:
  """A few steps of configs/lm.py's tiny variant into `workdir` (--smoke with a --workdir
  that holds no run: the evaluation part then runs end to end in seconds)."""
  from experiments import train  # pylint: disable=import-outside-toplevel
  config = lm_config.get_config("tiny")
  config.train.steps = 4
  config.eval.num_examples = 8
  train.train_and_evaluate(config, workdir)


def evaluation(workdir: str, runs: int, smoke: bool) -> list[str]:
  if smoke and not os.path.exists(os.path.join(workdir, "config.json")):
    _tiny_run(workdir)
  runner, params = _restore(workdir)
  by_recompute = _recompute_decoder(runner)
  fns = {"KV cache": lambda: runner.decode(params),
         "KV cache, int8": lambda: runner.decode(params, cache_dtype=jnp.int8),
         "prefix recomputed": lambda: by_recompute(params)}
  out = timing.in_turns(fns, runs)
  refs, floats = [t for _, t in runner.pairs], out["KV cache"][1]
  rows = []
  for name, (seconds, hyps) in out.items():
    exact = np.mean([h == r for h, r in zip(hyps, refs)])
    same = sum(h == f for h, f in zip(hyps, floats))
    rows.append(f"| {name} | {seconds:.2f} | {100 * exact:.1f}% | {same} of {len(refs)} |")
  speedup = out["prefix recomputed"][0] / out["KV cache"][0]
  return [f"The held-out evaluation's greedy answers ({len(refs)} dates), `{workdir}`:", "",
          "| path | seconds (median) | exact match | answers identical to the float cache's |",
          "|---|---|---|---|", *rows, "",
          f"Speed-up of the cache: {speedup:.1f}x."]


def _restore(workdir: str):
  from experiments import generate  # pylint: disable=import-outside-toplevel
  return generate.restore_params(workdir)


def _recompute_decoder(runner):
  """The held-out answers as the LM runner produced them before the cache: the whole prefix
  recomputed each step (experiments.lm.generate_by_recompute)."""
  from experiments import lm_data  # pylint: disable=import-outside-toplevel

  def decode(params):
    out, size = [], runner.decode_batch_size
    for i in range(0, len(runner.pairs), size):
      chunk = runner.pairs[i:i + size]
      chunk = chunk + [chunk[-1]] * (size - len(chunk))
      prompts, lengths = lm_data.prompts(runner.task, chunk,
                                         runner.prompt_room + runner.decode_length)
      tokens = np.asarray(lm.generate_by_recompute(runner.model, params, prompts, lengths,
                                                   runner.decode_length))
      out += [runner.task.vocab.decode(row[n:]) for row, n in zip(tokens, lengths)]
    return out[:len(runner.pairs)]

  return decode


def _mix(vocab: int, count: int, longest: int, most_new: int, shuffle: bool, seed: int):
  """Prompts of 16 to `longest` tokens (geometric, in order or shuffled) asking 16 to
  `most_new` new tokens each (shuffled)."""
  rng = np.random.default_rng(seed)
  lengths = np.geomspace(16, longest, count).astype(int)
  lengths = lengths[rng.permutation(count)] if shuffle else lengths
  limits = np.geomspace(16, most_new, count).astype(int)[rng.permutation(count)]
  return [rng.integers(3, vocab, n).astype(np.int32) for n in lengths], [int(n) for n in limits]


def _batched(model, params, prompts, limits, rows: int, page: int, runs: int):
  """(lines of the timing table, ServeStats) of continuous against static batching."""
  per_row = -(-max(len(p) + n for p, n in zip(prompts, limits)) // page)
  fns = {"continuous (paged)": lambda: serving.serve(
             model, params, prompts, limits, batch_size=rows, page_size=page,
             num_pages=rows * per_row),
         "static (padded groups)": lambda: static_batching.serve_static(
             model, params, prompts, limits, batch_size=rows)}
  out = timing.in_turns(fns, runs)
  (t_cont, (got_cont, stats)), (t_static, (got_static, _)) = out.values()
  assert got_cont == got_static, "continuous and static batching answered differently"
  new_tokens = sum(map(len, got_cont))
  lengths = [len(p) for p in prompts]
  return [f"{len(prompts)} prompts of {min(lengths)} to {max(lengths)} tokens, {min(limits)} "
          f"to {max(limits)} new tokens each ({new_tokens} in all), {rows} rows:", "",
          "| batching | seconds (median) | tokens/s |", "|---|---|---|",
          f"| continuous, paged | {t_cont:.2f} | {new_tokens / t_cont:.1f} |",
          f"| static | {t_static:.2f} | {new_tokens / t_static:.1f} |", "",
          f"Continuous / static tokens/s: {t_static / t_cont:.2f}x.", ""], stats


def serving_part(smoke: bool, runs: int) -> list[str]:
  vocab, rows, page = 64, 4, 16
  model, params = _model(vocab, smoke)
  prompts, limits = _mix(vocab, 6 if smoke else 16, 64 if smoke else 2048,
                         16 if smoke else 256, False, 0)
  lines, stats = _batched(model, params, prompts, limits, rows, page, runs)
  varied = _mix(vocab, 6 if smoke else 12, 64 if smoke else 2048, 16 if smoke else 512, True,
                1)
  lines += ["The same with the prompts shuffled, so that a static group pads to a long prompt and "
            "runs to its longest request:", "",
            *_batched(model, params, *varied, rows, page, runs)[0]]
  cfg = model.config
  bytes_per_token = 2 * cfg.num_kv_heads * (cfg.d_model // cfg.num_heads) * 4
  global_layers = sum(not cfg.is_local(i) for i in range(cfg.num_layers))
  peak_bytes = stats.peak_pages * page * bytes_per_token * global_layers
  held = stats.peak_tokens * bytes_per_token * global_layers
  in_pages = stats.peak_tokens_in_pages * bytes_per_token * global_layers
  longest = max(len(p) + n for p, n in zip(prompts, limits))
  contiguous = rows * longest * bytes_per_token * global_layers
  return [*lines,
          "The first mix's cache, at the peak of pages in use:", "",
          "| global layers' cache at the peak | bytes | vs tokens held, rounded up to pages "
          "| vs tokens held |", "|---|---|---|---|",
          f"| pages in use ({stats.peak_pages} x {page} tokens) | {peak_bytes:,} | "
          f"{peak_bytes / in_pages:.3f}x | {peak_bytes / held:.3f}x |",
          f"| tokens held, in pages ({stats.peak_tokens_in_pages}) | {in_pages:,} | 1.000x | "
          f"{in_pages / held:.3f}x |",
          f"| tokens held ({stats.peak_tokens}) | {held:,} | | 1.000x |",
          f"| contiguous: {rows} rows x longest request | {contiguous:,} | "
          f"{contiguous / in_pages:.2f}x | {contiguous / held:.2f}x |"]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", action="append",
                      choices=("cached", "eval", "serving", "prefix", "online", "int8"))
  parser.add_argument("--workdir", help="a trained configs/lm.py run, for the eval part")
  parser.add_argument("--smoke", action="store_true", help="tiny sizes, nothing written")
  parser.add_argument("--out", default="docs/generation_cpu.md")
  args = parser.parse_args()
  parts = args.part or ["cached", "serving"] + (["eval"] if args.workdir else [])
  runs = 1 if args.smoke else 3
  sizes = (2, 8, 8) if args.smoke else (8, 64, 448)
  sections = {"cached": lambda: cached(*sizes, runs, args.smoke),
              "eval": lambda: evaluation(args.workdir, runs, args.smoke),
              "serving": lambda: serving_part(args.smoke, runs),
              "prefix": lambda: serving_parts.prefix_part(64, _fields(args.smoke), args.smoke,
                                                          runs),
              "online": lambda: serving_parts.online_part(64, _fields(args.smoke), args.smoke,
                                                          runs),
              "int8": lambda: serving_parts.int8_part(
                  64, _fields(args.smoke), *_mix(64, 6 if args.smoke else 16,
                                                 64 if args.smoke else 2048,
                                                 16 if args.smoke else 256, False, 0),
                  args.smoke, runs)}
  timing.write_report("Generation (CPU, float32)", "python -m experiments.bench.generation",
                      parts, sections, args.out, args.smoke)


if __name__ == "__main__":
  main()
