"""The HTTP server end to end: `python -m flax_mha.serving.http` as a subprocess on 127.0.0.1
(an ephemeral port) over a tiny Llama checkpoint that transformers builds, with a chat template
and an API key, talked to by the real `openai` client (sync, async, streaming) and by raw HTTP.
Greedy text equals offline `serve`'s and transformers' `generate`'s; 32 concurrent streams each
get their own answer; a disconnect and a burst past the queue leave no page behind; a bad input
never stops the next request; SIGTERM and SIGINT drain. A model trained here is served by
`python -m experiments.serve` (tests/serving/test_http_lm_integration.py)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time

import httpx
import numpy as np
import pytest

import hf_checkpoints
from flax_mha import serving
from flax_mha.models import hf
from flax_mha.serving.http import launch

from test_http_text import TEMPLATES, saved_tokenizer

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.integration

KEY = "sk-flax-mha-test"
NAME = "tiny-llama"
FLAGS = ["--batch-size", "4", "--max-length", "2048", "--page-size", "8", "--max-waiting", "40",
         "--served-model-name", NAME, "--grace", "60"]
PROMPTS = ["The quick model reads", "A red bird sees the old house", "Every token",
           "Slow river, bright stone and"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  directory = tmp_path_factory.mktemp("tiny_llama")
  hf_checkpoints.save_tiny("llama", directory)
  return directory, saved_tokenizer(directory, TEMPLATES["chatml"])


@pytest.fixture(scope="module")
def server(checkpoint):
  with launch.Launched(["--checkpoint", str(checkpoint[0]), *FLAGS],
                       env={"FLAX_MHA_API_KEY": KEY}) as running:
    yield running


def offline(directory, prompts, max_new_tokens):
  """serve's greedy tokens (no stop token: the requests ask ignore_eos) and their texts."""
  model, variables = hf.load(directory)
  tokenizer = hf.load_tokenizer(directory)
  tokens, _ = serving.serve(model, variables, prompts, max_new_tokens, batch_size=4,
                            page_size=8, num_pages=64)
  return tokens, [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]


def test_the_openai_client_gets_offline_and_transformers_greedy_text(server, checkpoint):
  directory, hf_tokenizer = checkpoint
  ids = [hf_tokenizer(p)["input_ids"] for p in PROMPTS]
  new = 12
  tokens, texts = offline(directory, ids, new)
  assert tokens == hf_checkpoints.hf_generate(directory, ids, new)
  client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
  assert [m.id for m in client.models.list().data] == [NAME]
  for prompt, want in zip(PROMPTS, texts):
    got = client.completions.create(model=NAME, prompt=prompt, max_tokens=new, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == want and got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == new
  by_ids = client.completions.create(model=NAME, prompt=ids[1], max_tokens=new, temperature=0,
                                     extra_body={"ignore_eos": True})
  assert by_ids.choices[0].text == texts[1] and by_ids.usage.prompt_tokens == len(ids[1])

  async def streamed(prompt):
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY) as aclient:
      stream = await aclient.completions.create(
          model=NAME, prompt=prompt, max_tokens=new, temperature=0, stream=True,
          stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
      chunks = [chunk async for chunk in stream]
    return chunks

  chunks = asyncio.run(streamed(PROMPTS[2]))
  assert "".join(c.choices[0].text for c in chunks if c.choices) == texts[2]
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == new


def test_chat_is_rendered_by_the_checkpoints_template(server, checkpoint):
  """The chat prompt is apply_chat_template's ids: the answer is transformers' greedy answer
  to them, streamed or not."""
  directory, hf_tokenizer = checkpoint
  messages = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "Hi?"}]
  ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
  want = hf_tokenizer.decode(hf_checkpoints.hf_generate(directory, [ids], 10)[0],
                             skip_special_tokens=True)
  client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
  got = client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=10,
                                       temperature=0, extra_body={"ignore_eos": True})
  assert got.choices[0].message.content == want and got.usage.prompt_tokens == len(ids)
  stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10,
                                          temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
  chunks = list(stream)
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks) == want


def test_stop_strings_seeds_and_eos(server):
  client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
  full = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                   extra_body={"ignore_eos": True}).choices[0].text
  stop = full[5:8]
  cut = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True}).choices[0]
  assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"
  draw = lambda seed: client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=12,
                                                temperature=1.0, seed=seed,
                                                extra_body={"ignore_eos": True, "top_k": 20}
                                                ).choices[0].text
  assert draw(7) == draw(7) and draw(7) != draw(8)


def test_32_concurrent_streams_each_get_their_own_answer(server, checkpoint):
  directory, hf_tokenizer = checkpoint
  rng = np.random.default_rng(0)
  words = "the quick model reads every token a red bird sees old house river".split()
  prompts = [" ".join(rng.choice(words, rng.integers(2, 12))) for _ in range(32)]
  limits = [int(n) for n in rng.integers(4, 17, 32)]
  _, want = offline(directory, [hf_tokenizer(p)["input_ids"] for p in prompts], limits)

  async def one(aclient, prompt, limit):
    stream = await aclient.completions.create(model=NAME, prompt=prompt, max_tokens=limit,
                                              temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})
    return "".join([c.choices[0].text async for c in stream])

  async def all_of_them():
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY,
                                  max_retries=0) as aclient:
      return await asyncio.gather(*(one(aclient, p, n) for p, n in zip(prompts, limits)))

  assert asyncio.run(all_of_them()) == want
  assert_pages_back(server)


def metric(page: str, name: str) -> float:
  return float(re.search(rf"^{name} (\S+)$", page, re.M).group(1))


def assert_pages_back(server, timeout=30.0):
  """Every page free or held by a prefix entry, nothing running, within `timeout` s."""
  deadline = time.monotonic() + timeout
  while True:
    page = httpx.get(server.url + "/metrics").text
    back = metric(page, "flax_mha_free_pages") + metric(page, "flax_mha_cached_pages")
    idle = metric(page, "flax_mha_requests_running") + metric(page, "flax_mha_requests_waiting")
    if back == metric(page, "flax_mha_pages") and idle == 0:
      return page
    assert time.monotonic() < deadline, page
    time.sleep(0.2)


def test_a_client_that_disconnects_gives_its_pages_back(server):
  """A stream closed after its first chunk, and a non-streaming request given up on: each is
  cancelled (counted as aborted, far fewer tokens made than asked) and its pages come back."""
  headers = {"Authorization": f"Bearer {KEY}"}
  body = {"model": NAME, "prompt": PROMPTS[3], "max_tokens": 2000, "temperature": 0,
          "stream": True, "ignore_eos": True}
  aborted = lambda: metric(httpx.get(server.url + "/metrics").text,
                           "flax_mha_requests_aborted_total")
  made = lambda: metric(httpx.get(server.url + "/metrics").text, "flax_mha_new_tokens_total")
  before, tokens = aborted(), made()
  with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers) as r:
    assert next(line for line in r.iter_lines() if line.startswith("data:"))
  assert_pages_back(server)
  with pytest.raises(httpx.ReadTimeout):
    httpx.post(server.url + "/v1/completions", json=dict(body, stream=False), headers=headers,
               timeout=0.3)
  assert_pages_back(server)
  assert aborted() == before + 2 and made() - tokens < 2000


BAD = [
    (b"{oops", 400), ({"model": NAME, "prompt": "x", "max_tokens": -5}, 400),
    ({"model": NAME, "prompt": "x", "max_tokens": 10_000}, 400),
    ({"model": NAME, "prompt": [1, 2, 100_000]}, 400), ({"model": "other", "prompt": "x"}, 404),
    ({"model": NAME, "prompt": "x", "n": 3}, 400), ({"model": NAME, "prompt": {"a": 1}}, 400),
    ({"model": NAME, "messages": [{"role": "user"}], "tools": [1]}, 400),
]


@pytest.mark.parametrize("body,status", BAD)
def test_a_bad_input_gets_its_error_and_the_next_request_succeeds(server, body, status):
  headers = {"Authorization": f"Bearer {KEY}"}
  path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else (
      "/v1/completions")
  send = dict(content=body) if isinstance(body, bytes) else dict(json=body)
  bad = httpx.post(server.url + path, headers=headers, timeout=60, **send)
  assert bad.status_code == status and set(bad.json()["error"]) >= {"message", "type", "code"}
  assert "Traceback" not in bad.text
  good = httpx.post(server.url + "/v1/completions", headers=headers, timeout=60,
                    json={"model": NAME, "prompt": "Every", "max_tokens": 3, "temperature": 0})
  assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] in ("stop",
                                                                                    "length")


def test_without_the_key_or_with_a_wrong_one_nothing_is_served(server):
  for key in ("", "sk-wrong"):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key or "x", max_retries=0,
                           default_headers={} if key else {"Authorization": ""})
    with pytest.raises(openai.AuthenticationError) as info:
      client.completions.create(model=NAME, prompt="x", max_tokens=2)
    assert info.value.body["code"] == "invalid_api_key"


def test_a_bounded_burst_is_answered_or_refused_by_name_and_leaks_nothing(server):
  """60 requests in about 3 s (up to 40 wait): each a 200 or a 429 naming the full queue."""
  async def burst():
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"},
                                 timeout=120) as http:
      async def one(i):
        await asyncio.sleep(i * 0.05)
        return await http.post(server.url + "/v1/completions", json={
            "model": NAME, "prompt": PROMPTS[i % 4], "max_tokens": 6 + i % 5, "temperature": 0})
      return await asyncio.gather(*(one(i) for i in range(60)))

  answers = asyncio.run(burst())
  codes = [a.status_code for a in answers]
  assert set(codes) <= {200, 429} and codes.count(200) >= 40, codes
  assert all(a.json()["error"]["code"] == "queue_full" for a in answers if a.status_code == 429)
  page = assert_pages_back(server)
  assert metric(page, 'flax_mha_http_requests_total{route="/v1/completions",status="200"}') >= 40


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_drains_then_exits_zero(checkpoint, sig):
  """Admissions stop (503) at once; the stream in flight ends whole ([DONE]); exit status 0."""
  with launch.Launched(["--checkpoint", str(checkpoint[0]), *FLAGS]) as running:
    assert httpx.get(running.url + "/health").status_code == 200  # it listens once it says so
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 1500, "temperature": 0,
            "stream": True, "ignore_eos": True}
    lines, first = [], threading.Event()

    def read():
      with httpx.stream("POST", running.url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
          lines.append(line)
          first.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first.wait(60)
    running.process.send_signal(sig)
    time.sleep(0.5)
    refused = httpx.post(running.url + "/v1/completions", timeout=30,
                         json={"model": NAME, "prompt": "x", "max_tokens": 2})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    reader.join(120)
    assert running.process.wait(120) == 0, "".join(running.output)
  data = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
  assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"
  assert data[-1]["choices"][0]["finish_reason"] == "length"
