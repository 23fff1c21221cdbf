"""Tokenizers: a checkpoint's own ``tokenizer.json``, or a built-in byte-level one for presets.

The byte tokenizer maps each UTF-8 byte to the token whose id is the byte's value (0-255), plus the specials
``<|bos|>`` (256) and ``<|eos|>`` (257). It is a byte-level BPE without merges, built with the HF
``tokenizers`` library, so its ``tokenizer.json`` also loads in transformers' ``PreTrainedTokenizerFast``.
The byte-to-character table is GPT-2's ``bytes_to_unicode`` (Radford et al., openai/gpt-2 encoder.py), which
``tokenizers``' ByteLevel pre-tokenizer and decoder use too.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
UNKNOWN_PLACEHOLDER = "\ufffd"


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table (256 entries)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def make_byte_tokenizer() -> Tokenizer:
    """A byte-level ``tokenizers.Tokenizer``: ids 0-255 are the bytes, 256 ``<|bos|>``, 257 ``<|eos|>``.

    ``decode(encode(text).ids)`` returns ``text`` exactly for any str; encoding adds no special tokens.
    """
    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BOS_TOKEN, special=True, normalized=False),
                            AddedToken(EOS_TOKEN, special=True, normalized=False)])
    assert tok.token_to_id(BOS_TOKEN) == 256 and tok.token_to_id(EOS_TOKEN) == 257
    return tok


def byte_tokenizer_config(model_max_length: int) -> dict:
    """The ``tokenizer_config.json`` that lets transformers' AutoTokenizer load the byte tokenizer."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }


class TokenizerWrapper:
    """Encode/decode with a ``tokenizers.Tokenizer`` plus the ids a runtime needs.

    Attributes:
        tokenizer: the underlying ``tokenizers.Tokenizer``.
        bos_token_id / eos_token_id: int or None.
        eos_token_ids: every id that ends generation (tuple, possibly empty).
        vocab_size: ids the tokenizer knows (with added tokens); larger ids decode to ``UNKNOWN_PLACEHOLDER``.
        note: a one-line message when the built-in byte tokenizer stands in for a missing one, else None.
    """

    def __init__(self, tokenizer: Tokenizer, *, bos_token_id: int | None, eos_token_ids: Sequence[int],
                 note: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.note = note

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's own post-processing, e.g. a Llama BOS, when it has one)."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Ids the tokenizer does not know (negative or >= vocab_size) become
        ``UNKNOWN_PLACEHOLDER`` rather than raising: models may have more rows than their tokenizer."""
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            i = int(i)
            if 0 <= i < self.vocab_size:
                run.append(i)
                continue
            if run:
                out.append(self.tokenizer.decode(run, skip_special_tokens=skip_special_tokens))
                run = []
            out.append(UNKNOWN_PLACEHOLDER)
        if run:
            out.append(self.tokenizer.decode(run, skip_special_tokens=skip_special_tokens))
        return "".join(out)

    def __repr__(self) -> str:
        return f"TokenizerWrapper(vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_ids})"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}


def _token_id(tok: Tokenizer, value: object) -> int | None:
    """An id from a config value: an int, a token string, or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        return tok.token_to_id(value)
    return None


def _ids(value: object) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def load_tokenizer(model_dir: str | os.PathLike[str] | None) -> TokenizerWrapper:
    """The tokenizer of checkpoint directory ``model_dir``, or the byte tokenizer.

    Uses ``model_dir/tokenizer.json`` when present. BOS/EOS come from ``tokenizer_config.json`` (token
    strings), then ``generation_config.json`` and ``config.json`` (ids; a list of EOS ids is kept whole).
    With ``model_dir`` None (a preset) returns the byte tokenizer (bos 256, eos 257), and ``note`` says so. A
    directory without tokenizer.json also gets the byte tokenizer, with a UserWarning, but its bos/eos ids are
    the checkpoint's own (generation_config.json, then config.json; none if neither names one): the fallback
    never changes when the model stops.

    Raises:
        ValueError: ``model_dir/tokenizer.json`` exists but cannot be parsed (message names the file).
    """
    if model_dir is not None:
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if path.is_file():
            try:
                tok = Tokenizer.from_file(str(path))
            except Exception as e:  # tokenizers raises a bare Exception on bad JSON
                raise ValueError(f"{path} is not a valid tokenizers JSON file ({e}); fix or delete it") from None
            tcfg, gcfg, mcfg = (_read_json(d / n) for n in
                                ("tokenizer_config.json", "generation_config.json", "config.json"))
            bos = _token_id(tok, tcfg.get("bos_token"))
            if bos is None:
                bos = next(iter(_ids(gcfg.get("bos_token_id")) or _ids(mcfg.get("bos_token_id"))), None)
            eos: list[int] = _ids(gcfg.get("eos_token_id")) or _ids(mcfg.get("eos_token_id"))
            tok_eos = _token_id(tok, tcfg.get("eos_token"))
            if tok_eos is not None:
                eos = [tok_eos] + [i for i in eos if i != tok_eos]
            return TokenizerWrapper(tok, bos_token_id=bos, eos_token_ids=eos)
        gcfg, mcfg = _read_json(d / "generation_config.json"), _read_json(d / "config.json")
        eos = _ids(gcfg.get("eos_token_id")) or _ids(mcfg.get("eos_token_id"))
        bos = next(iter(_ids(gcfg.get("bos_token_id")) or _ids(mcfg.get("bos_token_id"))), None)
        note = (f"{d} has no tokenizer.json; using the built-in byte-level tokenizer (ids 0-255 are bytes), so "
                f"text prompts and completions are not this model's tokens; stopping uses the checkpoint's eos ids "
                f"{eos} (generation_config.json / config.json)")
        warnings.warn(note, stacklevel=2)
        return TokenizerWrapper(make_byte_tokenizer(), bos_token_id=bos, eos_token_ids=eos, note="warning: " + note)
    note = "note: using the built-in byte-level tokenizer (ids 0-255 are bytes, 256 <|bos|>, 257 <|eos|>)"
    return TokenizerWrapper(make_byte_tokenizer(), bos_token_id=256, eos_token_ids=[257], note=note)
