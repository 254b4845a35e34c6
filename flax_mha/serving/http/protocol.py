"""The OpenAI protocol as the server speaks it: typed request bodies (pydantic, strict, unknown
fields refused), their checks, what a request asks of the engine (`Job`), the response bodies
and chunks, and OpenAI's error body.

Supported: `/v1/completions` (`prompt`: a string or token ids, or a list of one of them) and
`/v1/chat/completions` (`messages` of a role and a string content, or a list of text parts,
joined by newlines as vLLM joins them); `max_tokens` (`max_completion_tokens` for chat),
`temperature` (0: greedy), `top_p`, `top_k` (an extension, as vLLM's: 0 or -1 none), `seed`,
`stop` (up to 4 strings), `n` = 1, `stream` with `stream_options.include_usage`, `user`, and
the extension `ignore_eos`. A field that would change the answer in a way this server does not
do (logprobs, penalties, echo, tools, n > 1, ...) is refused with a 400 naming it, never
ignored; the same fields at their no-op values (`presence_penalty: 0`, `logprobs: false`,
`n: 1`, ...) are accepted, since common clients send them.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from typing import Any, Literal

import pydantic

from flax_mha.models import sampling

# OpenAI's bounds: at most 4 stop strings; temperature in [0, 2].
MAX_STOPS = 4
MAX_TEMPERATURE = 2.0


class APIError(Exception):
  """An error answered in OpenAI's shape: status, message, type, param, code."""

  def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
               param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.type, self.param, self.code = (status, message, type_,
                                                                    param, code)

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


def from_validation(error: pydantic.ValidationError) -> APIError:
  """A 400 naming the first field pydantic refused."""
  first = error.errors()[0]
  param = ".".join(str(p) for p in first["loc"]) or None
  if first["type"] == "extra_forbidden":
    return APIError(400, f"Unrecognized request argument supplied: {param}", param=param,
                    code="unsupported_parameter")
  got = first.get("input")
  shown = repr(got) if len(repr(got)) <= 80 else f"{type(got).__name__}"
  return APIError(400, f"{param}: {first['msg']} (got {shown})", param=param,
                  code="invalid_value")


class _Body(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
  include_usage: bool = False
  continuous_usage_stats: Literal[False] = False


class _Sampling(_Body):
  """What both endpoints take."""
  model: str
  temperature: float | None = pydantic.Field(None, ge=0, le=MAX_TEMPERATURE)
  top_p: float | None = pydantic.Field(None, gt=0, le=1)
  top_k: int | None = pydantic.Field(None, ge=-1)
  seed: int | None = pydantic.Field(None, ge=0, lt=2**31)
  stop: str | list[str] | None = None
  n: Literal[1] = 1
  stream: bool = False
  stream_options: StreamOptions | None = None
  user: str | None = None
  ignore_eos: bool = False
  presence_penalty: Literal[0] | None = None
  frequency_penalty: Literal[0] | None = None
  logit_bias: dict[str, Any] | None = pydantic.Field(None, max_length=0)
  logprobs: Literal[False, None] = None

  @pydantic.field_validator("stop")
  @classmethod
  def _stops(cls, stop):
    stops = [stop] if isinstance(stop, str) else (stop or [])
    if len(stops) > MAX_STOPS or not all(stops):
      raise ValueError(f"at most {MAX_STOPS} non-empty strings")
    return stops

  def sampler(self):
    """Greedy at temperature 0; else sampling (OpenAI's default temperature is 1)."""
    temperature = 1.0 if self.temperature is None else self.temperature
    top_k = None if self.top_k in (None, 0, -1) else self.top_k
    top_p = None if self.top_p in (None, 1) else self.top_p
    if temperature == 0:
      return sampling.Greedy()
    return sampling.Sampling(temperature=temperature, top_k=top_k, top_p=top_p)


class CompletionRequest(_Sampling):
  prompt: str | list[pydantic.StrictInt] | list[str] | list[list[pydantic.StrictInt]]
  max_tokens: int | None = pydantic.Field(16, ge=1)  # OpenAI's default for completions
  echo: Literal[False] = False
  suffix: None = None
  best_of: Literal[1] | None = None

  def one_prompt(self) -> str | list[int]:
    """The request's one prompt. Raises APIError for a list of several."""
    prompt = self.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
      if len(prompt) != 1:
        raise APIError(400, f"prompt: one prompt per request, got a list of {len(prompt)}",
                       param="prompt")
      prompt = prompt[0]
    if not prompt:
      raise APIError(400, "prompt: it is empty", param="prompt")
    return prompt


class TextPart(_Body):
  type: Literal["text"]
  text: str


class Message(_Body):
  role: Literal["system", "developer", "user", "assistant"]
  content: str | list[TextPart] | None = None
  name: str | None = None

  def as_dict(self) -> dict:
    content = self.content
    if isinstance(content, list):
      content = "\n".join(part.text for part in content)
    return {"role": self.role, "content": content, "name": self.name}


class ChatRequest(_Sampling):
  messages: list[Message] = pydantic.Field(min_length=1)
  max_tokens: int | None = pydantic.Field(None, ge=1)
  max_completion_tokens: int | None = pydantic.Field(None, ge=1)
  top_logprobs: Literal[0] | None = None
  response_format: dict[str, Literal["text"]] | None = None
  tools: list[Any] | None = pydantic.Field(None, max_length=0)
  tool_choice: Literal["none"] | None = None
  parallel_tool_calls: bool | None = None


@dataclasses.dataclass(frozen=True)
class Job:
  """What one request asks the engine: prompt ids, new tokens at most, how to draw, when to
  stop."""
  prompt: list[int]
  max_tokens: int
  sampler: Any
  seed: int | None
  stops: tuple[str, ...]
  ignore_eos: bool
  source: str = "prompt"  # the field the prompt came from ("messages" for chat)


def new_id(prefix: str) -> str:
  return f"{prefix}-{secrets.token_hex(12)}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, text: str, finish: str, use: dict) -> dict:
  return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
          "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
          "usage": use}


def completion_chunk(rid: str, model: str, text: str | None, finish: str | None,
                     use: dict | None = None, with_usage: bool = False) -> dict:
  """A stream chunk; text None: the usage chunk (no choices)."""
  choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None,
                                      "finish_reason": finish}]
  chunk = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
           "choices": choices}
  return dict(chunk, usage=use) if with_usage else chunk


def chat_body(rid: str, model: str, text: str, finish: str, use: dict) -> dict:
  return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
          "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                       "logprobs": None, "finish_reason": finish}],
          "usage": use}


def chat_chunk(rid: str, model: str, delta: dict | None, finish: str | None,
               use: dict | None = None, with_usage: bool = False) -> dict:
  """A stream chunk; delta None: the usage chunk (no choices)."""
  choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                       "finish_reason": finish}]
  chunk = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
           "model": model, "choices": choices}
  return dict(chunk, usage=use) if with_usage else chunk
