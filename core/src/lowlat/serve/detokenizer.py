"""Incremental detokenization and stop strings for one streamed request.

Text is decoded with the tokenizer over a sliding window of ids, after vLLM's prefix-offset scheme
(vllm/transformers_utils/detokenizer_utils.py): decode ``ids[prefix:read]`` and ``ids[prefix:]`` and emit the
difference, so tokenizers whose pieces depend on their left context (SentencePiece spaces, byte-level BPE) give
the same text as decoding the whole sequence. Text ending in U+FFFD (an incomplete UTF-8 sequence) is held
back until a later token completes it, the request ends, or ``MAX_HELD_TOKENS`` tokens are held (then the U+FFFD
is real: an id the tokenizer does not know, as with presets' random weights), so the window stays short.
When stop strings are set, the last ``max(len(stop)) - 1`` characters are held back too, so a stop string
split over tokens is never streamed; a matched stop string is cut off (OpenAI semantics: the stop sequence is
not part of the text).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"
MAX_HELD_TOKENS = 4  # a UTF-8 character has at most 4 bytes, so at most 4 tokens complete it


class IncrementalDetokenizer:
    """Turn a growing list of token ids into text deltas.

    Args:
        tokenizer: has ``decode(ids, skip_special_tokens=...)`` (``lowlat.loader.TokenizerWrapper``).
        stop: stop strings (empty ones are ignored).
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # all decoded text so far (stop-truncated once stopped)
        self.sent = 0  # characters of ``text`` already emitted
        self._prefix = 0
        self._read = 0
        self.stopped = False

    def add(self, new_ids: Sequence[int]) -> str:
        """Append ids; returns the text that can be emitted now ("" while held back). Sets ``stopped``."""
        if self.stopped:
            return ""
        self.ids.extend(int(i) for i in new_ids)
        prefix_text = self.tokenizer.decode(self.ids[self._prefix:self._read])
        full = self.tokenizer.decode(self.ids[self._prefix:])
        held = len(self.ids) - self._read
        if len(full) > len(prefix_text) and (not full.endswith(REPLACEMENT) or held >= MAX_HELD_TOKENS):
            self.text += full[len(prefix_text):]
            self._prefix, self._read = self._read, len(self.ids)
        return self._emit(final=False)

    def finish(self) -> str:
        """The request ended: flush whatever was held back (an incomplete sequence stays as U+FFFD)."""
        if not self.stopped:
            prefix_text = self.tokenizer.decode(self.ids[self._prefix:self._read])
            full = self.tokenizer.decode(self.ids[self._prefix:])
            self.text += full[len(prefix_text):]
            self._prefix = self._read = len(self.ids)
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.stop and not self.stopped:
            start = max(0, self.sent - self.hold)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.stopped = True
        end = len(self.text) if (final or self.stopped) else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent:end]
        self.sent = end
        return out
