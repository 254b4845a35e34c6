"""The HTTP app in process (fastapi's TestClient), on requests that never reach the device loop:
every bad input, a missing or wrong key, a full queue and a draining server get their status in
OpenAI's error body, naming what is wrong, and nothing is submitted. What the loop answers is
tests/serving/test_http_integration.py."""

from __future__ import annotations

import argparse
import dataclasses

import jax.numpy as jnp
import pytest

pytest.importorskip("fastapi")

from fastapi import testclient  # noqa: E402

from flax_mha import serving  # noqa: E402
from flax_mha.models import speculative  # noqa: E402
from flax_mha.serving.http import cli  # noqa: E402
from flax_mha.serving.http import app as app_lib  # noqa: E402
from flax_mha.serving.http import chat  # noqa: E402
from flax_mha.serving.http.engine import Engine, Served  # noqa: E402

from helpers import random_params  # noqa: E402
from test_serving import VOCAB, lm  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Letters:
  """A toy tokenizer: a..q are ids 0..16."""
  vocab_size: int = VOCAB

  def encode(self, text):
    if not set(text) <= set("abcdefghijklmnopq"):
      raise ValueError(f"characters outside a..q in {text!r}")
    return [ord(c) - ord("a") for c in text]

  encode_chat = encode

  def decode(self, ids):
    return "".join(chr(ord("a") + i) for i in ids)


KEY = "sk-test-123"


@pytest.fixture(scope="module")
def server():
  model, params = lm()
  return serving.Server(model, params, batch_size=2, page_size=4, num_pages=16, max_length=32)


def client(server, *, template=None, max_waiting=8, api_key=KEY, **limits):
  served = Served("toy", server.model, server.params, Letters(),
                  None if template is None else chat.ChatTemplate(template), (2,))
  engine = Engine(served, server, max_waiting=max_waiting)
  app = app_lib.create_app(engine, api_key=api_key, **limits)
  return testclient.TestClient(app, headers={"Authorization": f"Bearer {KEY}"}), engine


def assert_error(response, status, param=None, code=None):
  assert response.status_code == status, response.text
  error = response.json()["error"]
  assert set(error) == {"message", "type", "param", "code"} and error["message"]
  assert "Traceback" not in response.text
  if param is not None:
    assert error["param"] == param, error
  if code is not None:
    assert error["code"] == code, error


BAD = [
    ("/v1/completions", b"{not json", 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, "invalid_json"),
    ("/v1/completions", {"model": "toy", "prompt": "abc", "max_tokens": -1}, 400, "max_tokens",
     None),
    ("/v1/completions", {"model": "toy", "prompt": "abc", "max_tokens": 30}, 400, "max_tokens",
     "context_length_exceeded"),
    ("/v1/completions", {"model": "toy", "prompt": "a" * 40, "max_tokens": 1}, 400, "prompt",
     "context_length_exceeded"),
    ("/v1/completions", {"model": "toy", "prompt": [1, 2, 99], "max_tokens": 2}, 400, "prompt",
     "invalid_prompt"),
    ("/v1/completions", {"model": "toy", "prompt": "xyz"}, 400, "prompt", "invalid_prompt"),
    ("/v1/completions", {"model": "toy", "prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {"model": "toy", "prompt": "abc", "temperature": "hot"}, 400,
     "temperature", None),
    ("/v1/completions", {"model": "toy", "prompt": "abc", "logprobs": 2}, 400, "logprobs", None),
    ("/v1/completions", {"model": "toy", "prompt": "abc", "best": 1}, 400, "best",
     "unsupported_parameter"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "abc"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": "abc"}, 400, "model", None),
    ("/v1/chat/completions", {"model": "toy", "messages": [{"role": "user", "content": "a"}]},
     400, "messages", "no_chat_template"),
    ("/v1/chat/completions", {"model": "toy", "messages": "hi"}, 400, "messages", None),
]


@pytest.mark.parametrize("path,body,status,param,code", BAD)
def test_a_bad_request_gets_its_error_and_nothing_is_submitted(server, path, body, status,
                                                               param, code):
  test_client, _ = client(server)
  with test_client:
    send = dict(content=body) if isinstance(body, bytes) else dict(json=body)
    assert_error(test_client.post(path, **send), status, param, code)
    assert not server.busy
    assert test_client.get("/health").status_code == 200


def test_the_key_is_required_on_v1_routes_only(server):
  test_client, _ = client(server)
  body = {"model": "toy", "prompt": "abc"}
  with test_client:
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer sk-wrong"},
                    {"Authorization": f"Basic {KEY}"}):
      assert_error(test_client.post("/v1/completions", json=body, headers=headers), 401,
                   code="invalid_api_key")
      assert_error(test_client.get("/v1/models", headers=headers), 401)
    assert test_client.get("/health", headers={"Authorization": ""}).status_code == 200
    assert test_client.get("/v1/models").json()["data"][0]["id"] == "toy"
  assert not server.busy


def test_limits_full_queue_and_draining_are_refused_by_name(server):
  test_client, engine = client(server, max_waiting=0, max_body_bytes=200, max_prompt_chars=10)
  with test_client:
    ok = {"model": "toy", "prompt": "abc", "max_tokens": 2}
    assert_error(test_client.post("/v1/completions", json=dict(ok, prompt="a" * 300)), 413,
                 code="body_too_large")
    assert_error(test_client.post("/v1/completions", json=dict(ok, prompt="a" * 11)), 400,
                 "prompt", "prompt_too_long")
    assert_error(test_client.post("/v1/completions", json=ok), 429, code="queue_full")
    engine.draining = True
    assert_error(test_client.post("/v1/completions", json=ok), 503, code="shutting_down")
    assert_error(test_client.get("/health"), 503)
  assert not server.busy


def test_unknown_routes_and_methods_answer_in_the_error_shape(server):
  test_client, _ = client(server, api_key=None)
  with test_client:
    assert_error(test_client.get("/v1/nothing"), 404)
    assert_error(test_client.get("/v1/completions"), 405)


def test_metrics_count_answers_and_show_the_pool(server):
  test_client, _ = client(server, api_key=None)
  with test_client:
    test_client.post("/v1/completions", json={"model": "nope", "prompt": "a"})
    page = test_client.get("/metrics").text
  assert 'flax_mha_http_requests_total{route="/v1/completions",status="404"} 1.0' in page
  assert "flax_mha_free_pages 16.0" in page and "flax_mha_pages 16.0" in page
  assert "flax_mha_requests_waiting 0.0" in page


def test_the_speculation_flags_name_a_drafter_or_what_is_missing():
  """--speculate ngram is prompt lookup, --speculate draft the checkpoint --draft-checkpoint
  names (read by the loader it is given), and a flag without its partner is refused by name;
  a draft model of another vocabulary is refused by the Server."""
  parser = argparse.ArgumentParser()
  cli.add_flags(parser)
  loaded = []
  load = lambda directory: (loaded.append(directory), lm())[1]
  pick = lambda *flags: cli.drafter(parser.parse_args(list(flags)), load)
  assert pick() is None and isinstance(pick("--speculate", "ngram"), speculative.PromptLookup)
  draft = pick("--speculate", "draft", "--draft-checkpoint", "d")
  assert isinstance(draft, speculative.DraftModel) and loaded == ["d"]
  for flags, match in ((["--draft-checkpoint", "d"], "--draft-checkpoint needs --speculate"),
                       (["--speculate", "draft"], "needs --draft-checkpoint DIR"),
                       (["--speculate", "ngram", "--draft-checkpoint", "d"], "not ngram")):
    with pytest.raises(ValueError, match=match):
      pick(*flags)
  model, params = lm()
  other = type(model)(dataclasses.replace(model.config, vocab_size=VOCAB + 1))
  x = jnp.zeros((1, 8), jnp.int32)
  with pytest.raises(ValueError, match=r"vocabulary must be the model's \(17 tokens\), got 18"):
    serving.Server(model, params, batch_size=2, page_size=4, num_pages=16, max_length=32,
                   drafter=speculative.DraftModel(other, random_params(other, x, x, x)))
