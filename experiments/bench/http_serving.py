"""Serving over HTTP under load: flax_mha's OpenAI-compatible server against transformers serve.

  python -m experiments.bench.http_serving            # -> docs/serving_http_cpu.md
  python -m experiments.bench.http_serving --smoke    # a tiny model, few requests: no file

The model: experiments.bench.hf's Llama of 124M parameters (random weights, float32, vocabulary
32000), saved with a tokenizer made here (`make_model_dir`: a BPE of 8000 tokens trained on
made-up words, its vocabulary filled up to the model's with tokens no text encodes to, so every
id decodes) and a generation_config.json without an end-of-sequence token, so that every request
generates exactly max_tokens on every system. Each request: a prompt of 40 made-up words (the
same tokens on every system: one tokenizer.json, no BOS added), 64 new tokens, greedy.

The systems, each a server process of its own on 127.0.0.1 (a free port), started and stopped
here, in turns (the order reversed every other turn); each is warmed up by a few untimed requests
(compilation), then runs every rate in turn, each rate with prompts of its own:
  flax_mha http        `python -m flax_mha.serving.http` (POST /v1/completions, `ignore_eos`)
  flax_mha in-process  `flax_mha.serving.Server` with its own thread, the same arrivals
                       submitted by threads in one worker process (`server.stream`): what HTTP
                       costs
  transformers cb      `transformers serve DIR --continuous-batching`
  transformers         `transformers serve DIR` (one `generate` at a time: the lowest rate only)
At each rate, `--requests` requests arrive as a Poisson process (the same seeded arrival times
and prompts for every system), each a streaming POST /v1/completions of its own connection
(async httpx, in this process). Reported per system and rate: output tokens/s over the run's
wall time, requests completed (exactly 64 tokens) and failed, time to the first token (TTFT) and
per output token after it (TPOT), median and p99 over the requests of all turns
(experiments.bench.http_load says how each is read). "inf" sends every request at once: the
system's throughput with its rows full. The saturation rate is the first at which transformers
serve --continuous-batching's throughput grows by less than 10% over the rate before.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from experiments.bench import hf
from experiments.bench import http_load
from experiments.bench import timing

SYSTEMS = ("flax_mha http", "flax_mha in-process", "transformers cb", "transformers")
RATES = (0.1, 0.25, 1.0, float("inf"))  # requests/s: transformers cb saturates below 0.25
WORDS, NEW, MAX_LENGTH = 40, 64, 192  # prompt words, new tokens, a row's tokens (16 pages)
TOKENIZER_VOCAB, LEXICON = 8000, 30000  # BPE tokens trained; made-up words
# Its defaults size the paged cache to a share of the host's memory: 12 GB of the 24 here.
TRANSFORMERS_CB = ["--continuous-batching", "--cb-block-size", "32", "--cb-num-blocks", "128",
                   "--cb-max-batch-tokens", "512"]  # 4096 tokens: 32 requests of 128
SPECIAL = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0-2 as hf.make_checkpoint's config says


@functools.cache
def _lexicon(size: int) -> list[str]:
  """`size` made-up words of 1-4 syllables."""
  rng = np.random.default_rng(0)
  syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"] + ["an", "el", "or", "is"]
  words = sorted({"".join(rng.choice(syllables, rng.integers(1, 5))) for _ in range(2 * size)})
  return rng.permutation(words)[:size].tolist()


def _text(words: int, seed: int) -> str:
  """`words` words of the lexicon, Zipf-distributed (the rare ones split into several tokens)."""
  lexicon = _lexicon(LEXICON)
  rng = np.random.default_rng(seed)
  ranks = (rng.zipf(1.1, words) - 1) % len(lexicon)
  return " ".join(lexicon[r] for r in ranks)


def make_model_dir(directory: pathlib.Path, smoke: bool) -> pathlib.Path:
  """hf.make_checkpoint's random Llama with a tokenizer (tokenizer.json, tokenizer_config.json)
  and a generation_config.json without an end-of-sequence token."""
  hf.make_checkpoint(directory, smoke)
  vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
  generation = dict(bos_token_id=1, pad_token_id=0, do_sample=False)  # no eos: max_tokens each
  (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
  if (directory / "tokenizer.json").is_file():
    return directory
  import tokenizers  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel
  tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
  tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
  trainer = trainers.BpeTrainer(vocab_size=min(TOKENIZER_VOCAB, vocab), special_tokens=list(SPECIAL),
                                show_progress=False)
  tokenizer.train_from_iterator((_text(100, seed) for seed in range(2000)), trainer)
  trained = json.loads(tokenizer.to_str())["model"]
  ids = dict(trained["vocab"])
  for i in range(len(ids), vocab):  # ids the model may emit: decodable, never encoded to
    ids[f"\u2581x{i}"] = i
  tokenizer.model = models.BPE(ids, [tuple(m) for m in trained["merges"]], unk_token="<unk>")
  assert tokenizer.get_vocab_size() == vocab, (tokenizer.get_vocab_size(), vocab)
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>",
                                              bos_token="<s>", eos_token="</s>",
                                              unk_token="<unk>")
  fast.save_pretrained(directory)
  return directory


def prompts(count: int, seed: int) -> list[str]:
  """`count` prompts of WORDS words."""
  return [_text(WORDS, seed * 100_000 + i) for i in range(count)]


def _schedules(rates, count: int) -> list[tuple[float, list[str], list[float]]]:
  """(rate, prompts, send times) of each rate: the same for every system."""
  return [(rate, prompts(count, 1 + i), http_load.arrivals(count, rate, seed=1 + i))
          for i, rate in enumerate(rates)]


def _inprocess_worker(args) -> dict:
  """The in-process system's runs (a worker process): rate -> records. The Server is built as
  `python -m flax_mha.serving.http` builds it (its flags' defaults), prompts encoded by its
  tokenizer, every request run to max_tokens (its `ignore_eos`)."""
  from flax_mha.serving.http import cli  # pylint: disable=import-outside-toplevel
  parser = argparse.ArgumentParser()
  cli.add_flags(parser)
  flags = parser.parse_args(["--batch-size", str(args.batch_size), "--max-length",
                             str(MAX_LENGTH)])
  served = cli.hf_served(args.checkpoint)
  encode = lambda texts: [served.tokenizer.encode(t) for t in texts]
  load = lambda texts, schedule: http_load.inprocess_load(
      server, encode(texts), args.new, schedule, args.timeout, ignore_stop_tokens=True)
  out = {}
  with cli.build_server(served, flags) as server:
    load(prompts(args.warmup, 0), [0.0] * args.warmup)
    for rate, texts, schedule in _schedules(_rates(args), args.requests):
      out[str(rate)] = load(texts, schedule)
  return out


def _command(system: str, directory, port: int, batch: int) -> list[str]:
  if system == "flax_mha http":
    return [sys.executable, "-m", "flax_mha.serving.http", "--checkpoint", str(directory),
            "--host", "127.0.0.1", "--port", str(port), "--batch-size", str(batch),
            "--max-length", str(MAX_LENGTH)]
  script = shutil.which("transformers", path=os.path.dirname(sys.executable)) or "transformers"
  return [script, "serve", str(directory), "--host", "127.0.0.1", "--port", str(port),
          "--device", "cpu", "--dtype", "float32",
          *(TRANSFORMERS_CB if system == "transformers cb" else [])]


def _body(system: str, model: str, prompt: str, new: int) -> dict:
  body = dict(model=model, prompt=prompt, max_tokens=new, temperature=0, stream=True,
              stream_options={"include_usage": True})
  if system == "flax_mha http":
    body["ignore_eos"] = True  # transformers refuses the field: its checkpoint has no eos
  return body


def _http_system(system: str, args, scratch: pathlib.Path) -> dict:
  """An HTTP system's runs: its server started, warmed up, every rate, stopped."""
  port = http_load.free_port()
  log = scratch / f"{system.replace(' ', '_')}.log"
  with http_load.ServerProcess(_command(system, args.checkpoint, port, args.batch_size), port,
                               log, ready_timeout=args.timeout) as server:
    url, model = f"{server.url}/v1/completions", server.model()
    bodies = lambda texts: [_body(system, model, t, args.new) for t in texts]
    warm = http_load.http_load(url, bodies(prompts(args.warmup, 0)), [0.0] * args.warmup,
                               args.timeout)
    if not all(r["ok"] for r in warm):
      raise RuntimeError(f"{system}: a warm-up request failed: {warm}\n{log.read_text()[-2000:]}")
    out = {}
    for rate, texts, schedule in _schedules(_rates(args), args.requests):
      if system == "transformers" and rate != min(_rates(args)):
        continue  # one generate at a time: the lowest rate is enough to show it
      out[str(rate)] = http_load.http_load(url, bodies(texts), schedule, args.timeout)
  return out


def _rates(args) -> list[float]:
  return [float(r) for r in args.rates.split(",")]


def _available(system: str) -> bool:
  import importlib.util  # pylint: disable=import-outside-toplevel
  return system != "flax_mha http" or importlib.util.find_spec("flax_mha.serving.http") is not None


def run_systems(args, systems: list[str]) -> dict:
  """system -> rate -> the records of each turn."""
  results = {s: {} for s in systems}
  scratch = pathlib.Path(tempfile.mkdtemp(prefix="flax_mha_http_"))
  for turn in range(args.turns):
    for system in systems if turn % 2 == 0 else systems[::-1]:
      print(f"turn {turn}: {system}", file=sys.stderr, flush=True)
      if system == "flax_mha in-process":
        lines = timing.run_worker([sys.executable, "-m", "experiments.bench.http_serving",
                                   "--time-case", system, *_passed(args)])
        runs = json.loads(lines[-1])
      else:
        runs = _http_system(system, args, scratch)
      for rate, records in runs.items():
        results[system].setdefault(rate, []).append(records)
  return results


def _passed(args) -> list[str]:
  """The options a worker needs, as given."""
  return ["--checkpoint", str(args.checkpoint), "--batch-size", str(args.batch_size),
          "--rates", args.rates, "--requests", str(args.requests), "--warmup", str(args.warmup),
          "--timeout", str(args.timeout), "--new", str(args.new)]


def _summaries(turns: list[list[dict]], new: int) -> dict:
  """A rate's summary over its turns: latencies over all requests, the median throughput."""
  pooled = http_load.summary([r for records in turns for r in records], new)
  each = [http_load.summary(records, new).get("throughput", 0.0) for records in turns]
  pooled["throughput"] = float(np.median(each)) if pooled["completed"] else 0.0
  return pooled


def report(results: dict, args, missing: list[str]) -> list[str]:
  rows = ["| system | rate (req/s) | completed / failed | output tokens/s | TTFT p50 ms | "
          "TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |", "|---|---|---|---|---|---|---|---|"]
  table, notes = {}, []
  for system, rates in results.items():
    for rate, turns in rates.items():
      s = table[system, rate] = _summaries(turns, args.new)
      latency = " | ".join(f"{s[k][0]:.0f} | {s[k][1]:.0f}" if k in s else "- | -"
                           for k in ("ttft", "tpot"))
      rows.append(f"| {system} | {rate} | {s['completed']} / {s['failed']} | "
                  f"{s['throughput']:.1f} | {latency} |")
      if s["errors"]:
        notes.append(f"{system} at {rate}: failed with {'; '.join(s['errors'][:3])}")
  load = " and ".join(f"{a:.1f}" for a in args.load)
  return [f"{_machine()} Load average {load} at the start and the end (2 cores: other work "
          "shared the machine when it exceeds 2).", "",
          f"{args.requests} requests per rate and turn, {args.turns} turn(s); prompts of {WORDS} "
          f"made-up words, {args.new} new tokens, greedy; flax_mha's batch {args.batch_size} "
          f"rows, max length {MAX_LENGTH}; transformers cb: `transformers serve DIR "
          f"{' '.join(TRANSFORMERS_CB)}`.", "", *rows, "",
          *[f"- {n}" for n in notes + [f"{m}: not run (not installed)" for m in missing]],
          "", *_saturation(table)]


def _saturation(table: dict) -> list[str]:
  """Where transformers cb's throughput stops growing, and flax_mha beside it there."""
  rates = sorted((float(r), r) for (s, r) in table if s == "transformers cb")
  if not rates:
    return []
  speed = [table["transformers cb", r]["throughput"] for _, r in rates]
  at = next((i for i in range(1, len(rates)) if speed[i] < 1.1 * speed[i - 1]), None)
  if at is None:
    return ["transformers cb's throughput still grows at the highest rate."]
  rate = rates[at][1]
  lines = [f"transformers cb saturates at {rate} requests/s ({speed[at]:.1f} tokens/s, "
           f"{speed[at - 1]:.1f} at {rates[at - 1][1]})."]
  theirs = table["transformers cb", rate]
  for system in ("flax_mha http", "flax_mha in-process"):
    ours = table.get((system, rate))
    if ours and "ttft" in ours and "ttft" in theirs:
      lines.append(f"{system} there: {ours['throughput'] / speed[at]:.2f}x its throughput; "
                   f"TTFT p50 {ours['ttft'][0]:.0f} ms against {theirs['ttft'][0]:.0f}, TPOT p50 "
                   f"{ours['tpot'][0]:.0f} ms against {theirs['tpot'][0]:.0f}.")
  return lines


TRANSFORMERS_NEEDS = [
    "What `transformers serve` needed (5.24), beside the checkpoint:",
    "- tokenizer.json and tokenizer_config.json (`PreTrainedTokenizerFast.save_pretrained`); no "
    "chat template for /v1/completions;",
    "- a prompt as a string (a list of token ids is refused) and no `ignore_eos` (an unknown "
    "field is refused, 422): the checkpoint's generation_config.json has no eos_token_id, so "
    "`generate` never stops early and continuous batching sets it to -1 (off);",
    "- the model's name in requests is the directory as given to `serve` (GET /v1/models lists "
    "it); `stream_options` is ignored with a warning, the usage comes in the last chunk anyway, "
    "and no `data: [DONE]` ends the stream;",
    "- with `--continuous-batching`, the `--cb-*` sizes above: by default the paged cache takes a "
    "share of the host's memory (12 GB resident here)."]


def _machine() -> str:
  cpuinfo = pathlib.Path("/proc/cpuinfo").read_text()
  name = next((l.split(":", 1)[1].strip() for l in cpuinfo.splitlines()
               if l.startswith("model name")), "unknown")
  avx512 = "avx512" in cpuinfo
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=False).stdout.strip()
  return (f"Machine: {name}, {os.cpu_count()} cores, "
          f"{'with AVX-512 (the faster type)' if avx512 else 'without AVX-512 (the slower type)'}"
          f"; at {commit or 'an unknown commit'}, float32.")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="a tiny model, few requests, one "
                      "rate, nothing written")
  parser.add_argument("--out", default="docs/serving_http_cpu.md")
  parser.add_argument("--checkpoint", default=None, help="the model's directory (default: a "
                      "scratch one, made here)")
  parser.add_argument("--systems", default=",".join(SYSTEMS), help="a comma-separated subset")
  parser.add_argument("--rates", default=",".join(map(str, RATES)), help="requests/s, "
                      "comma-separated; inf: all at once")
  parser.add_argument("--requests", type=int, default=8, help="requests per rate and turn")
  parser.add_argument("--turns", type=int, default=1)
  parser.add_argument("--warmup", type=int, default=4, help="untimed requests, all at once")
  parser.add_argument("--batch-size", type=int, default=8, help="flax_mha's rows")
  parser.add_argument("--timeout", type=float, default=300, help="seconds a server may take "
                      "to be ready, and a request after the last one is sent")
  parser.add_argument("--new", type=int, default=NEW, help="new tokens per request")
  parser.add_argument("--time-case", default=None, help=argparse.SUPPRESS)  # a worker's system
  args = parser.parse_args()
  if args.time_case:
    print(json.dumps(_inprocess_worker(args)))
    return
  if args.smoke:
    args.rates, args.requests, args.warmup, args.turns, args.new = "4", 4, 2, 1, 8
  scratch = (tempfile.mkdtemp(prefix="flax_mha_bench_") if args.smoke else
             os.path.join(tempfile.gettempdir(), "flax_mha_bench_http"))  # kept: 0.5 GB
  args.checkpoint = make_model_dir(pathlib.Path(args.checkpoint or scratch), args.smoke)
  systems = [s for s in SYSTEMS if s in args.systems.split(",")]
  missing = [s for s in systems if not _available(s)]
  args.load = [os.getloadavg()[0]]
  results = run_systems(args, [s for s in systems if s not in missing])
  args.load.append(os.getloadavg()[0])
  command = "python -m experiments.bench.http_serving"
  timing.write_report("Serving over HTTP under load (CPU)", command,
                      ["load", "transformers serve"],
                      {"load": lambda: report(results, args, missing),
                       "transformers serve": lambda: TRANSFORMERS_NEEDS}, args.out, args.smoke)


if __name__ == "__main__":
  main()
