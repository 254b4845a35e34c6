"""The command line: `python -m flax_mha.serving.http --checkpoint DIR` serves a Hugging Face
checkpoint directory (config.json, safetensors, tokenizer.json; its chat template when it has
one) over the OpenAI protocol. `experiments.serve` serves a model trained here with the same
flags (`add_flags`, `serve`).

  python -m flax_mha.serving.http --checkpoint path/to/model --port 8000 [--api-key KEY]
  flax-mha-serve --checkpoint path/to/model                  # the same, as a console script

It binds 127.0.0.1 unless --host says otherwise, and says so; compiles the serving loop before
it listens (one request of one token), then prints `listening on http://HOST:PORT` (--port 0:
a free port, the one printed). SIGTERM or SIGINT: admissions stop (503), requests being
answered finish within --grace seconds, and the process exits 0; a second signal exits now.
An unreadable checkpoint prints one line, `error: <why>`, and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import socket
import sys
import time

import uvicorn

from flax_mha.models import decoding
from flax_mha.models import speculative
from flax_mha.serving import server as server_lib
from flax_mha.serving.http import app as app_lib
from flax_mha.serving.http import chat
from flax_mha.serving.http.engine import Engine, Served

API_KEY_ENV = "FLAX_MHA_API_KEY"
# Trips of the loop between two looks of the host: a request that arrives mid-run waits for the
# run's end, so fewer trips admit sooner and stream in smaller pieces; a look costs a host
# sync of the small state (see docs/serving_http_cpu.md for the measurement).
SEGMENT_STEPS = 4


def add_flags(parser: argparse.ArgumentParser) -> None:
  """The server's flags (every model source shares them)."""
  add = parser.add_argument
  add("--host", default="127.0.0.1", help="the address to bind (default: loopback only)")
  add("--port", type=int, default=8000, help="the port (0: a free one, printed)")
  add("--served-model-name", help="the model's name in requests (default: the directory's)")
  add("--api-key", default=os.environ.get(API_KEY_ENV),
      help=f"require `Authorization: Bearer KEY` on /v1 routes (default: ${API_KEY_ENV})")
  add("--batch-size", type=int, default=8, help="rows decoded at once")
  add("--page-size", type=int, default=16, help="tokens per cache page")
  add("--max-length", type=int, default=2048,
      help="the longest request, prompt and new tokens (capped at the model's positions)")
  add("--num-pages", type=int, help="pages in the pool (default: every row at --max-length)")
  add("--segment-steps", type=int, default=SEGMENT_STEPS,
      help="loop trips between two looks of the host: fewer stream tokens in smaller pieces "
      "and admit sooner, more run longer between host syncs")
  add("--max-waiting", type=int, default=256, help="requests waiting before 429")
  add("--grace", type=float, default=30.0, help="seconds a shutdown waits for requests")
  add("--max-body-bytes", type=int, default=1 << 20, help="the largest request body")
  add("--max-prompt-chars", type=int, default=1 << 18, help="the longest prompt text")
  add("--speculate", choices=("ngram", "draft"),
      help="speculative decoding: prompt lookup (ngram) or a draft model (--draft-checkpoint)")
  add("--num-speculative-tokens", type=int, default=4,
      help="with --speculate: the most drafts a row proposes a round")
  add("--draft-checkpoint", help="with --speculate draft: the draft model's checkpoint, in the "
      "model's form, with the model's vocabulary")


def drafter(args, load):
  """The drafter the flags name (None without --speculate); load(directory) -> (model,
  params) reads a draft checkpoint. Raises ValueError for flags that do not go together."""
  if args.speculate is None:
    if args.draft_checkpoint is not None:
      raise ValueError("--draft-checkpoint needs --speculate draft")
    return None
  if args.speculate == "ngram":
    if args.draft_checkpoint is not None:
      raise ValueError("--draft-checkpoint goes with --speculate draft, not ngram")
    return speculative.PromptLookup()
  if args.draft_checkpoint is None:
    raise ValueError("--speculate draft needs --draft-checkpoint DIR")
  return speculative.DraftModel(*load(args.draft_checkpoint))


def build_server(served: Served, args, draft=None) -> server_lib.Server:
  """The Server of `served` sized by the flags, speculating with `draft` (a drafter, or None)."""
  limit = decoding.position_limit(served.model)
  max_length = args.max_length if limit is None else min(args.max_length, limit)
  extra = 0 if draft is None else args.num_speculative_tokens  # a round's writes past the end
  pages_per_row = -(-(max_length + extra) // args.page_size)
  return server_lib.Server(served.model, served.params, batch_size=args.batch_size,
                           page_size=args.page_size,
                           num_pages=args.num_pages or args.batch_size * pages_per_row,
                           max_length=max_length, stop_tokens=served.stop_tokens,
                           segment_steps=args.segment_steps, drafter=draft,
                           num_speculative_tokens=args.num_speculative_tokens)


def serve(served: Served, args, draft=None) -> None:
  """Build, compile, bind, and answer until a signal (see the module docstring)."""
  server = build_server(served, args, draft)
  warm = server.submit([0], 1, ignore_stop_tokens=True)
  server.run()  # compiles the loop before anyone waits on it
  assert warm.finished
  engine = Engine(served, server, max_waiting=args.max_waiting)
  app = app_lib.create_app(engine, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                           max_prompt_chars=args.max_prompt_chars)
  sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  sock.bind((args.host, args.port))
  host, port = sock.getsockname()[:2]
  where = "loopback only" if args.host in ("127.0.0.1", "::1", "localhost") else (
      "every interface: anyone who reaches this machine" if args.host in ("0.0.0.0", "::")
      else args.host)
  key = "an API key" if args.api_key else "no API key"
  speculating = "" if draft is None else (f", speculating with {type(draft).__name__} (up to "
                                          f"{args.num_speculative_tokens} drafts a round)")
  print(f"serving {served.name!r} on {host} ({where}), {key}; max_length "
        f"{server.max_length}, {args.batch_size} rows{speculating}", flush=True)
  config = uvicorn.Config(app, log_level="warning", access_log=False,
                          timeout_graceful_shutdown=max(int(args.grace), 1))
  Draining(config, engine, args.grace, f"http://{host}:{port}").run(sockets=[sock])
  print("stopped", flush=True)


class Draining(uvicorn.Server):
  """uvicorn, whose first SIGTERM or SIGINT drains (new requests 503, the others finish within
  `grace` seconds) before it stops, and exits 0; a second signal stops now."""

  def __init__(self, config, engine: Engine, grace: float, url: str):
    super().__init__(config)
    self.engine, self.grace, self.url, self.loop = engine, grace, url, None

  async def serve(self, sockets=None):
    self.loop = asyncio.get_running_loop()
    await super().serve(sockets)

  async def startup(self, sockets=None):
    await super().startup(sockets)
    if not self.should_exit:
      print(f"listening on {self.url}", flush=True)  # accepting now: a client may connect

  def handle_exit(self, sig, frame):
    del frame
    if self.engine.draining or self.loop is None:
      self.should_exit = self.force_exit = True
      return
    self.engine.draining = True
    print(f"signal {sig}: draining {self.engine.active} requests (at most {self.grace} s)",
          flush=True)
    self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._drain()))

  async def _drain(self):
    deadline = time.monotonic() + self.grace
    while self.engine.active and time.monotonic() < deadline:
      await asyncio.sleep(0.02)
    self.should_exit = True


def hf_served(directory, name=None, dtype=None) -> Served:
  """A Hugging Face checkpoint directory as the server serves it."""
  from flax_mha.models import hf  # pylint: disable=import-outside-toplevel  (the hf extra)

  model, variables = hf.load(directory, dtype=dtype)
  return Served(name or pathlib.Path(directory).resolve().name, model, variables,
                chat.HFTokenizer(hf.load_tokenizer(directory)),
                chat.ChatTemplate.from_directory(directory), hf.stop_tokens(directory))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m flax_mha.serving.http",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", required=True, help="a Hugging Face checkpoint directory")
  parser.add_argument("--dtype", help="the parameters' dtype (default: the checkpoint's)")
  add_flags(parser)
  args = parser.parse_args(argv)
  try:
    served = hf_served(args.checkpoint, args.served_model_name, args.dtype)
    from flax_mha.models import hf  # pylint: disable=import-outside-toplevel  (the hf extra)
    draft = drafter(args, lambda directory: hf.load(directory, dtype=args.dtype))
  except (ValueError, FileNotFoundError, TypeError) as e:
    sys.exit(f"error: {e}")
  serve(served, args, draft)
