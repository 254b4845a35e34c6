"""The FastAPI application: OpenAI's routes on an `engine.Engine`.

  POST /v1/completions, POST /v1/chat/completions   (stream: SSE chunks, then `data: [DONE]`)
  GET  /v1/models, GET /health, GET /metrics (Prometheus text)

Every error is OpenAI's body (`protocol.APIError`) with its status: 400 for a body that is not
JSON, a field of the wrong type or range, an unsupported field, a prompt past the context or
with ids outside the vocabulary; 401 without the API key (when one is set: every /v1 route);
404 for an unknown model or route; 413 for a body over `max_body_bytes`; 429 with the waiting
queue full; 503 while shutting down; 500 for anything else, without a traceback. Bodies are
read up to `max_body_bytes` and prompt texts bounded by `max_prompt_chars` before they are
tokenized.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time

import fastapi
import pydantic
from fastapi import responses
from starlette.exceptions import HTTPException as StarletteHTTPException

from flax_mha.serving.http import metrics as metrics_lib
from flax_mha.serving.http import protocol
from flax_mha.serving.http.engine import Engine
from flax_mha.serving.http.protocol import APIError

LOG = logging.getLogger(__name__)


def create_app(engine: Engine, *, api_key: str | None = None, max_body_bytes: int = 1 << 20,
               max_prompt_chars: int = 1 << 18) -> fastapi.FastAPI:
  """The application serving `engine` (started and stopped with the app's lifespan)."""
  metrics = metrics_lib.Metrics(engine)

  @contextlib.asynccontextmanager
  async def lifespan(_):
    engine.start(asyncio.get_running_loop())
    try:
      yield
    finally:
      await asyncio.to_thread(engine.stop)

  app = fastapi.FastAPI(title="flax_mha", lifespan=lifespan, docs_url=None, redoc_url=None,
                        openapi_url=None)
  app.state.engine, app.state.metrics = engine, metrics

  @app.exception_handler(APIError)
  async def api_error(_, error: APIError):
    return responses.JSONResponse(error.body(), status_code=error.status)

  @app.exception_handler(StarletteHTTPException)
  async def http_error(_, error):
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(error.status_code,
                                                                      "invalid_request_error")
    return responses.JSONResponse(APIError(error.status_code, str(error.detail), kind).body(),
                                  status_code=error.status_code)

  @app.exception_handler(Exception)
  async def internal_error(_, error):
    LOG.error("internal error", exc_info=error)  # in the server's log, never to a client
    return responses.JSONResponse(APIError(500, "internal error", "server_error").body(),
                                  status_code=500)

  app.add_middleware(Guard, api_key=api_key, metrics=metrics)

  async def body_of(request: fastapi.Request, kind):
    raw = await _read_bounded(request, max_body_bytes)
    try:
      obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
      raise APIError(400, f"the body must be a JSON object, got {type(obj).__name__}",
                     code="invalid_json")
    try:
      body = kind.model_validate(obj)
    except pydantic.ValidationError as e:
      raise protocol.from_validation(e) from None
    if body.model != engine.served.name:
      raise APIError(404, f"The model `{body.model}` does not exist: this server serves "
                     f"`{engine.served.name}`", "not_found_error", "model", "model_not_found")
    return body

  @app.post("/v1/completions")
  async def completions(request: fastapi.Request):
    body = await body_of(request, protocol.CompletionRequest)
    prompt = body.one_prompt()
    if isinstance(prompt, str):
      _check_chars(prompt, max_prompt_chars, "prompt")
      try:
        prompt = engine.served.tokenizer.encode(prompt)
      except ValueError as e:  # a text the tokenizer cannot encode (a character-level one)
        raise APIError(400, f"prompt: {e}", param="prompt", code="invalid_prompt") from None
    job = _job(body, prompt, body.max_tokens)
    return await _answer(engine, request, body, job, chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: fastapi.Request):
    body = await body_of(request, protocol.ChatRequest)
    template = engine.served.chat_template
    if template is None:
      raise APIError(400, f"the model `{engine.served.name}` has no chat template: use "
                     "/v1/completions", param="messages", code="no_chat_template")
    messages = [m.as_dict() for m in body.messages]
    _check_chars("".join(m["content"] or "" for m in messages), max_prompt_chars, "messages")
    try:
      text = await asyncio.to_thread(template.render, messages)
    except ValueError as e:
      raise APIError(400, str(e), param="messages", code="invalid_messages") from None
    prompt = engine.served.tokenizer.encode_chat(text)
    limit = body.max_completion_tokens or body.max_tokens
    if limit is None:  # the rest of the context, as OpenAI's chat default
      limit = max(engine.server.max_length - len(prompt), 1)
    return await _answer(engine, request, body, _job(body, prompt, limit, "messages"),
                         chat=True)

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": engine.served.name, "object": "model",
                                         "created": 0, "owned_by": "flax_mha",
                                         "max_model_len": engine.server.max_length}]}

  @app.get("/health")
  async def health():
    if engine.draining:
      raise APIError(503, "the server is shutting down", "service_unavailable",
                     code="shutting_down")
    return {"status": "ok"}

  @app.get("/metrics")
  async def prometheus():
    return responses.Response(metrics.render(), media_type=metrics_lib.CONTENT_TYPE)

  return app


class Guard:
  """ASGI middleware (pure, so that a disconnect still reaches a streaming response): the API
  key of /v1 routes checked before anything is read, every answer counted in the metrics."""

  def __init__(self, app, api_key: str | None, metrics):
    self.app, self.api_key, self.metrics = app, api_key, metrics

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    started, status = time.perf_counter(), []

    async def send_and_note(message):
      if message["type"] == "http.response.start":
        status.append(message["status"])
      await send(message)

    try:
      if self.api_key is not None and scope["path"].startswith("/v1") and not _key_ok(
          dict(scope["headers"]).get(b"authorization", b""), self.api_key):
        error = APIError(401, "Incorrect API key provided: give it as `Authorization: Bearer "
                         "KEY`", code="invalid_api_key")
        response = responses.JSONResponse(error.body(), status_code=401)
        return await response(scope, receive, send_and_note)
      return await self.app(scope, receive, send_and_note)
    finally:
      self.metrics.answered(scope["path"], status[0] if status else 499,
                            time.perf_counter() - started)


def _key_ok(given: bytes, api_key: str) -> bool:
  scheme, _, token = given.partition(b" ")
  return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), api_key.encode())


async def _read_bounded(request: fastapi.Request, limit: int) -> bytes:
  declared = request.headers.get("content-length")
  if declared is not None and declared.isdigit() and int(declared) > limit:
    raise APIError(413, f"the body has {declared} bytes, more than the limit of {limit}",
                   code="body_too_large")
  chunks, size = [], 0
  async for chunk in request.stream():
    size += len(chunk)
    if size > limit:
      raise APIError(413, f"the body is over the limit of {limit} bytes", code="body_too_large")
    chunks.append(chunk)
  return b"".join(chunks)


def _check_chars(text: str, limit: int, param: str) -> None:
  if len(text) > limit:
    raise APIError(400, f"{param}: {len(text)} characters, more than the limit of {limit}",
                   param=param, code="prompt_too_long")


def _job(body, prompt: list[int], max_tokens: int, source: str = "prompt") -> protocol.Job:
  return protocol.Job(list(prompt), max_tokens, body.sampler(), body.seed, tuple(body.stop or ()),
                      body.ignore_eos, source)


async def _answer(engine: Engine, request: fastapi.Request, body, job: protocol.Job, *,
                  chat: bool):
  handle = engine.admit(job)
  rid = protocol.new_id("chatcmpl" if chat else "cmpl")
  pieces = engine.pieces(job, handle)
  if body.stream:
    usage = body.stream_options is not None and body.stream_options.include_usage
    return responses.StreamingResponse(
        _sse(pieces, rid, engine.served.name, len(job.prompt), chat, usage),
        media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
  collect = asyncio.ensure_future(_collect(pieces))
  gone = asyncio.ensure_future(_disconnected(request))
  await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
  if not collect.done():  # the client went away: the reader stops, the request is cancelled
    collect.cancel()
    with contextlib.suppress(asyncio.CancelledError):
      await collect
    return responses.Response(status_code=499)
  gone.cancel()
  text, last = collect.result()
  use = protocol.usage(len(job.prompt), last.tokens)
  make = protocol.chat_body if chat else protocol.completion_body
  return make(rid, engine.served.name, text, last.finish, use)


async def _collect(pieces):
  text, last = [], None
  try:
    async for piece in pieces:
      text.append(piece.text)
      last = piece
  finally:
    await pieces.aclose()
  return "".join(text), last


async def _disconnected(request: fastapi.Request) -> None:
  while True:
    message = await request.receive()
    if message["type"] == "http.disconnect":
      return


async def _sse(pieces, rid: str, model: str, prompt_tokens: int, chat: bool, usage: bool):
  """The SSE stream: a chunk per piece (chat: the role first), the finish reason on the last,
  the usage chunk if asked, then [DONE]."""
  event = lambda obj: f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
  try:
    if chat:
      yield event(protocol.chat_chunk(rid, model, {"role": "assistant", "content": ""}, None,
                                      with_usage=usage))
    last = None
    async for piece in pieces:
      last = piece
      if chat:
        delta = {"content": piece.text} if piece.text or piece.finish is None else {}
        yield event(protocol.chat_chunk(rid, model, delta, piece.finish, with_usage=usage))
      else:
        yield event(protocol.completion_chunk(rid, model, piece.text, piece.finish,
                                              with_usage=usage))
    if usage:
      use = protocol.usage(prompt_tokens, last.tokens)
      chunk = protocol.chat_chunk if chat else protocol.completion_chunk
      yield event(chunk(rid, model, None, None, use, with_usage=True))
    yield "data: [DONE]\n\n"
  except RuntimeError:  # the serving loop failed: the status is sent, so an error event
    yield event(APIError(500, "internal error", "server_error").body())
    yield "data: [DONE]\n\n"
  finally:
    await pieces.aclose()
