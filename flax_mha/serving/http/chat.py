"""Chat prompts: a checkpoint's own chat template (Jinja) rendered as transformers'
`apply_chat_template(messages, add_generation_prompt=True, tokenize=False)` renders it, and
the tokenizer of a Hugging Face checkpoint as the server uses it.

Where the template is read, in transformers' order: chat_template.jinja, else
additional_chat_templates/default.jinja, else tokenizer_config.json's "chat_template" (a
string, or a list of {"name", "template"} whose "default" is taken). The template sees what
transformers gives it: `messages` (each a dict, keys whose value is None dropped), `tools` and
`documents` (None), `add_generation_prompt`, and the named special tokens of
tokenizer_config.json (bos_token, eos_token, ...); in a sandbox with transformers' helpers
(`raise_exception`, `strftime_now`, a `tojson` that does not escape HTML, loop controls).
The rendered text is tokenized without special tokens added (the template writes them).
"""

from __future__ import annotations

import datetime
import json
import pathlib

import jinja2
import jinja2.ext
from jinja2 import sandbox

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")


class TemplateError(ValueError):
  """A chat the template refuses (its own raise_exception) or cannot render."""


def _raise(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(format_):
  return datetime.datetime.now().strftime(format_)


class ChatTemplate:
  """A compiled chat template and the special tokens it sees."""

  def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
    self.source = source
    self.template = env.from_string(source)
    self.special_tokens = dict(special_tokens or {})

  def render(self, messages: list[dict]) -> str:
    """The prompt text of `messages` followed by the assistant's header. Raises TemplateError."""
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    try:
      return self.template.render(messages=messages, tools=None, documents=None,
                                  add_generation_prompt=True, **self.special_tokens)
    except jinja2.exceptions.TemplateError as e:
      raise TemplateError(f"the chat template refused the messages: {e}") from None
    except (TypeError, KeyError, AttributeError, IndexError) as e:
      raise TemplateError(f"the chat template cannot render the messages: {e}") from None

  @classmethod
  def from_directory(cls, directory) -> "ChatTemplate | None":
    """The template of a Hugging Face checkpoint directory, or None when it has none."""
    directory = pathlib.Path(directory)
    config = read_tokenizer_config(directory)
    for path in (directory / "chat_template.jinja",
                 directory / "additional_chat_templates" / "default.jinja"):
      if path.is_file():
        return cls(path.read_text(encoding="utf-8"), special_tokens(config))
    source = config.get("chat_template")
    if isinstance(source, list):
      source = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)
                }.get("default")
    return cls(source, special_tokens(config)) if isinstance(source, str) else None


def read_tokenizer_config(directory) -> dict:
  """tokenizer_config.json as a dict ({} when absent). Raises ValueError naming the file when it
  is not a JSON object."""
  path = pathlib.Path(directory) / "tokenizer_config.json"
  if not path.is_file():
    return {}
  try:
    config = json.loads(path.read_text(encoding="utf-8"))
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not JSON: {e}") from None
  if not isinstance(config, dict):
    raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
  return config


def special_tokens(config: dict) -> dict[str, str]:
  """The named special tokens of a tokenizer config (a string, or an AddedToken's dict)."""
  out = {}
  for name in SPECIAL_TOKENS:
    value = config.get(name)
    if isinstance(value, dict):
      value = value.get("content")
    if isinstance(value, str):
      out[name] = value
  return out


class HFTokenizer:
  """A checkpoint's tokenizer.json as the server uses it: prompts encoded as transformers
  encodes them (special tokens added: a BOS where the family's post-processor writes one), a
  rendered chat without, text decoded with special tokens skipped."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text).ids

  def encode_chat(self, text: str) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=False).ids

  def decode(self, ids) -> str:
    return self.tokenizer.decode(list(ids), skip_special_tokens=True)
