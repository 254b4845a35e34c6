"""The HTTP server's pure parts (flax_mha.serving.http): streamed text against the tokenizer's
own decode of every id at once, stop strings across token boundaries, chat templates against
transformers' `apply_chat_template`, the request bodies' checks. The app in process is
tests/serving/test_http_app.py; the server as a subprocess with the openai client is
tests/serving/test_http_integration.py."""

from __future__ import annotations

import json

import pydantic
import pytest

from flax_mha.serving.http import chat, protocol, text

import hf_checkpoints

pytest.importorskip("fastapi")
tokenizers = pytest.importorskip("tokenizers")

TEXTS = ["The quick model reads every token.", "Café, naïve, 日本語 and 🙂 emoji: ¿qué?",
         "  leading spaces\nand a newline\tand a tab", "ünïcödé🙂🙂 again"]


def metaspace_tokenizer():
  """A Llama-2-like tokenizer: BPE over "▁"-joined words with byte fallback (a character it
  never saw is its UTF-8 bytes, <0xNN> tokens), decoded by Replace, ByteFallback, Fuse and
  Strip: the decoder that drops the first token's leading space."""
  from tokenizers import decoders, models, normalizers, trainers

  tok = tokenizers.Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
  tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                         normalizers.Replace(" ", "▁")])
  tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=400, show_progress=False,
      special_tokens=["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)])
  tok.train_from_iterator(["The quick model reads every token", "a new red house"] * 20,
                          trainer=trainer)
  return tok


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def tokenizer(request, tmp_path_factory):
  if request.param == "byte_level":
    return hf_checkpoints.train_tokenizer(tmp_path_factory.mktemp("tok"))
  return metaspace_tokenizer()


@pytest.mark.parametrize("sample", TEXTS)
def test_streamed_pieces_join_to_the_whole_decode(tokenizer, sample):
  """Ids fed one at a time (a character split over several byte tokens included): the pieces
  join to decode(all ids); after each id, what went out is decode(the ids so far) whenever
  that ends in a whole character (nothing held longer than needed)."""
  ids = tokenizer.encode(sample).ids
  decode = lambda i: tokenizer.decode(i, skip_special_tokens=True)
  detokenizer = text.Detokenizer(decode)
  out = ""
  for n, i in enumerate(ids, 1):
    out += detokenizer.add([i])
    so_far = decode(ids[:n])
    if not so_far.endswith(text.REPLACEMENT):
      assert out == so_far, n
  assert out + detokenizer.flush() == decode(ids)


@pytest.mark.parametrize("stops,pieces,want", [
    (["END"], ["hel", "lo E", "N", "D and more"], "hello "),
    (["END"], ["no stop ", "at E", "n"], "no stop at En"),
    (["\n\n", "###"], ["a\n", "b\n", "\nc"], "a\nb"),
    (["abc", "bc"], ["xa", "bc"], "x"),  # the earliest match wins
    (["aab"], ["aa", "aa", "b!"], "aa"),
    (["x"], ["", "y", "x"], "y"),
])
def test_stop_strings_cut_across_pieces(stops, pieces, want):
  stop = text.StopStrings(stops)
  out = "".join(stop.add(p) for p in pieces) + stop.flush()
  assert out == want
  assert stop.stopped == (want != "".join(pieces))


def test_a_held_tail_goes_out_only_when_settled():
  stop = text.StopStrings(["STOP"])
  assert stop.add("go ST") == "go "
  assert stop.add("AY") == "STAY"
  assert stop.add("S") == ""
  assert stop.flush() == "S"


# Chat templates of the kinds the families ship: ChatML (Qwen), Llama 3's headers, Gemma's turns
# (a system message refused by raise_exception), Mistral's alternation check, and one using
# loop controls, tojson and namespace.
TEMPLATES = {
    "chatml": "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
              "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
              "{{ '<|im_start|>assistant\n' }}{% endif %}",
    "llama3": "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
              "'<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>"
              "\n\n' }}{% endif %}",
    "gemma": "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
             "{{ raise_exception('System role not supported') }}{% endif %}"
             "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
             "{{ '<start_of_turn>' + role + '\n' + m['content'] | trim + '<end_of_turn>\n' }}"
             "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}"
             "{% endif %}",
    "mistral": "{{ bos_token }}{% for m in messages %}{% if (m['role'] == 'user') != "
               "(loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate') }}"
               "{% endif %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
               "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}",
    "controls": "{% set ns = namespace(n=0) %}\n{% for m in messages %}\n  {% if m['role'] == "
                "'system' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
                "{{ ns.n }}:{{ m | tojson }}\n{% endfor %}{% if add_generation_prompt %}>"
                "{% endif %}",
}
CHATS = [
    [{"role": "user", "content": "Hello there!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b>\"x\"</b>"},
     {"role": "assistant", "content": " Hello. "}, {"role": "user", "content": "Again, ünï 🙂"}],
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
]


def saved_tokenizer(directory, template: str, as_list: bool = False):
  """A checkpoint's tokenizer files as transformers saves them, with `template` (in
  chat_template.jinja; or, as_list, in tokenizer_config.json as a list of named ones)."""
  import transformers

  hf_checkpoints.train_tokenizer(directory)
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_file=str(directory / "tokenizer.json"), bos_token="<bos>", eos_token="<eos>",
      pad_token="<pad>")
  fast.chat_template = template
  fast.save_pretrained(directory)
  if as_list:
    (directory / "chat_template.jinja").unlink()
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = [{"name": "other", "template": "nope"},
                               {"name": "default", "template": template}]
    path.write_text(json.dumps(config))
  return transformers.AutoTokenizer.from_pretrained(directory)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_chat_templates_render_as_transformers_renders_them(name, tmp_path):
  """The same text as apply_chat_template(tokenize=False, add_generation_prompt=True), the same
  ids as with tokenize=True; a chat the template refuses is refused on both sides."""
  theirs = saved_tokenizer(tmp_path, TEMPLATES[name], as_list=name == "controls")
  ours = chat.ChatTemplate.from_directory(tmp_path)
  tokenizer = chat.HFTokenizer(tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json")))
  for messages in CHATS:
    try:
      want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # pylint: disable=broad-except  (jinja's TemplateError)
      with pytest.raises(chat.TemplateError, match="refused"):
        ours.render(messages)
      continue
    got = ours.render(messages)
    assert got == want
    ids = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tokenizer.encode_chat(got) == list(ids)


def test_no_template_is_none_and_a_sandbox_escape_is_refused(tmp_path):
  hf_checkpoints.train_tokenizer(tmp_path)
  assert chat.ChatTemplate.from_directory(tmp_path) is None
  escape = chat.ChatTemplate("{{ messages.__class__.__mro__ }}")
  with pytest.raises(Exception, match="unsafe|access"):
    escape.render(CHATS[0])


def _body(kind, **fields):
  base = {"model": "m", "prompt": "x"} if kind is protocol.CompletionRequest else {
      "model": "m", "messages": [{"role": "user", "content": "x"}]}
  return kind.model_validate(dict(base, **fields))


@pytest.mark.parametrize("kind,fields,param", [
    (protocol.CompletionRequest, dict(max_tokens=0), "max_tokens"),
    (protocol.CompletionRequest, dict(max_tokens="8"), "max_tokens"),
    (protocol.CompletionRequest, dict(max_tokens=True), "max_tokens"),
    (protocol.CompletionRequest, dict(temperature=-0.1), "temperature"),
    (protocol.CompletionRequest, dict(temperature=2.5), "temperature"),
    (protocol.CompletionRequest, dict(top_p=0), "top_p"),
    (protocol.CompletionRequest, dict(n=2), "n"),
    (protocol.CompletionRequest, dict(logprobs=3), "logprobs"),
    (protocol.CompletionRequest, dict(echo=True), "echo"),
    (protocol.CompletionRequest, dict(presence_penalty=0.5), "presence_penalty"),
    (protocol.CompletionRequest, dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (protocol.CompletionRequest, dict(stop=[""]), "stop"),
    (protocol.CompletionRequest, dict(seed=-1), "seed"),
    (protocol.CompletionRequest, dict(prompt=[1, "a"]), "prompt"),
    (protocol.CompletionRequest, dict(best_of=3), "best_of"),
    (protocol.CompletionRequest, dict(frobnicate=1), "frobnicate"),
    (protocol.ChatRequest, dict(messages=[]), "messages"),
    (protocol.ChatRequest, dict(messages=[{"role": "wizard", "content": "x"}]), "messages"),
    (protocol.ChatRequest, dict(tools=[{"type": "function"}]), "tools"),
    (protocol.ChatRequest, dict(max_completion_tokens=-3), "max_completion_tokens"),
])
def test_a_bad_field_is_a_400_naming_it(kind, fields, param):
  with pytest.raises(pydantic.ValidationError) as info:
    _body(kind, **fields)
  error = protocol.from_validation(info.value)
  assert error.status == 400 and error.param.split(".")[0] == param, error.body()
  assert set(error.body()["error"]) == {"message", "type", "param", "code"}


def test_no_op_values_of_unsupported_fields_are_accepted_and_sampling_read():
  body = _body(protocol.CompletionRequest, n=1, presence_penalty=0, frequency_penalty=0.0,
               logprobs=None, echo=False, user="u", temperature=0, top_k=-1, stop="END")
  assert body.stop == ["END"] and body.sampler() == protocol.sampling.Greedy()
  sampled = _body(protocol.ChatRequest, temperature=0.5, top_k=5, top_p=0.9).sampler()
  assert sampled == protocol.sampling.Sampling(temperature=0.5, top_k=5, top_p=0.9)
  assert _body(protocol.CompletionRequest).sampler() == protocol.sampling.Sampling()  # T = 1
  with pytest.raises(protocol.APIError, match="one prompt per request"):
    _body(protocol.CompletionRequest, prompt=["a", "b"]).one_prompt()
  assert _body(protocol.CompletionRequest, prompt=[[5, 6]]).one_prompt() == [5, 6]
