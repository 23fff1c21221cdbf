"""Chat templates rendered the way transformers renders them (``PreTrainedTokenizerBase.apply_chat_template``).

Source of the template, first found wins: ``--chat-template FILE``; the checkpoint's ``chat_template.jinja``;
``chat_template.json``; ``tokenizer_config.json["chat_template"]`` (a string, or a list of named templates, of
which "default" is taken). Presets (and checkpoints without a template) use ``DEFAULT_TEMPLATE``, a ChatML-style
layout documented in the README. Rendering uses jinja2's ``ImmutableSandboxedEnvironment`` with
``trim_blocks``/``lstrip_blocks`` and the loopcontrols extension, a ``tojson`` that keeps non-ASCII, and the
globals ``raise_exception`` and ``strftime_now``; the variables are ``messages``, ``add_generation_prompt``,
the special tokens (``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``) and any extra keyword.
The rendered text is tokenized without adding special tokens (the template places them).
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Presets' default: ChatML with the byte tokenizer's specials spelled as text markers.
DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template cannot be read or rendering it failed (``raise_exception`` in the template, a bad message)."""


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def find_template(model_dir: str | None, override: str | None = None) -> tuple[str, str]:
    """(template source, where it came from). Raises ChatTemplateError when ``override`` cannot be read."""
    if override is not None:
        p = Path(override)
        try:
            return p.read_text(), str(p)
        except OSError as e:
            raise ChatTemplateError(f"--chat-template {override}: cannot read it ({e.strerror})") from None
    if model_dir is not None:
        d = Path(model_dir)
        if (d / "chat_template.jinja").is_file():
            return (d / "chat_template.jinja").read_text(), str(d / "chat_template.jinja")
        for name in ("chat_template.json", "tokenizer_config.json"):
            try:
                tmpl = json.loads((d / name).read_text()).get("chat_template") if (d / name).is_file() else None
            except (OSError, json.JSONDecodeError):
                tmpl = None
            if isinstance(tmpl, list):  # [{"name": ..., "template": ...}]
                named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
                tmpl = named.get("default") or next(iter(named.values()), None)
            if isinstance(tmpl, str) and tmpl:
                return tmpl, f"{d / name}"
    return DEFAULT_TEMPLATE, "lowlat default (ChatML)"


@dataclass
class ChatTemplate:
    """A compiled chat template plus the special tokens it may use.

    Args:
        source: the jinja2 text. ``origin``: where it came from (shown by ``lowlat serve`` at start).
        special_tokens: ``bos_token`` etc. as text.
    """

    source: str
    origin: str
    special_tokens: dict[str, str]

    def __post_init__(self) -> None:
        from jinja2 import TemplateSyntaxError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._compiled = env.from_string(self.source)
        except TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template from {self.origin} does not compile: {e}") from None

    @classmethod
    def load(cls, model_dir: str | None, override: str | None = None) -> ChatTemplate:
        """The template of checkpoint ``model_dir`` (None for a preset), or of file ``override``."""
        source, origin = find_template(model_dir, override)
        specials: dict[str, str] = {"bos_token": "", "eos_token": ""}
        if model_dir is None:
            from lowlat.loader.tokenizer import BOS_TOKEN, EOS_TOKEN

            specials = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN}
        else:
            p = Path(model_dir) / "tokenizer_config.json"
            try:
                cfg = json.loads(p.read_text()) if p.is_file() else {}
            except (OSError, json.JSONDecodeError):
                cfg = {}
            for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
                text = _token_text(cfg.get(key))
                if text is not None:
                    specials[key] = text
        return cls(source, origin, specials)

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               **extra: Any) -> str:
        """The prompt text of ``messages``. Raises ChatTemplateError with the template's own message."""
        from jinja2.exceptions import TemplateError

        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens, **extra)
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template rejected the messages: {e}") from None
