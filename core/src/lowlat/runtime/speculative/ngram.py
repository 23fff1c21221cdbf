"""The n-gram (prompt lookup) drafter.

Prompt lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding; vLLM's ``ngram`` proposer):
find an earlier occurrence of the request's last ``n`` tokens (prompt and output together) and propose the
tokens that followed it. Within the last ``window`` tokens, the longest match of the suffix (``n`` tokens, else
``n - 1`` ... 1) wins, the most recent on a tie. The continuation is copied LZ77-style: when it runs into the
suffix itself, it repeats with the match's period, so a request stuck in a loop of period ``p < k`` still gets
k drafts.

Per request the drafter keeps a numpy copy of its tokens (appending only what is new since the last call); the
search is one vectorised compare of the window against the last token, then ``n - 1`` compares over the
candidate positions only, no Python loop over positions: about 10 microseconds per request at the default
window of 1024 tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lowlat.runtime.scheduler import Request
from lowlat.runtime.speculative.drafter import Drafter, Drafts


class _Tokens:
    """A request's tokens: ``buf[:len]`` int64, grown by doubling."""

    __slots__ = ("buf", "len")

    def __init__(self) -> None:
        self.buf = np.zeros(256, dtype=np.int64)
        self.len = 0

    def sync(self, req: Request) -> np.ndarray:
        """Append the tokens of ``req`` not seen yet; returns the view of all of them."""
        total = len(req.prompt_ids) + len(req.output_ids)
        if total > self.len:
            if total > len(self.buf):
                grown = np.zeros(max(total, 2 * len(self.buf)), dtype=np.int64)
                grown[:self.len] = self.buf[:self.len]
                self.buf = grown
            np_ = len(req.prompt_ids)
            new = (req.prompt_ids + req.output_ids)[self.len:] if self.len < np_ else req.output_ids[self.len - np_:]
            self.buf[self.len:total] = new
            self.len = total
        return self.buf[:self.len]


def lookup(tokens: np.ndarray, n: int, k: int, window: int) -> list[int]:
    """Draft ``k`` tokens for the sequence ``tokens`` ([L] int64) by n-gram lookup; [] when nothing matches.

    Among the earlier positions of the last ``window`` tokens holding the last token (one vectorised compare),
    the one whose preceding tokens match the sequence's longest (up to ``n`` tokens) wins, the most recent on a
    tie; the tokens after it, repeated with the match's period where they overlap the suffix, are the drafts.
    """
    t = tokens[-window:]
    size = len(t)
    if size < 2:
        return []
    ends = np.flatnonzero(t[:size - 1] == t[size - 1])  # a match of the suffix ends at each of these
    if not ends.size:
        return []
    for m in range(1, min(n, size - 1)):  # grow the matches one suffix token at a time: a loop over n, not positions
        cand = ends[ends >= m] if ends[0] < m else ends
        longer = cand[t[cand - m] == t[size - 1 - m]]
        if not longer.size:
            break  # ``ends`` all match m tokens and none m + 1
        ends = longer
    end = int(ends[-1]) + 1  # the most recent of the longest matches; the drafts start after it
    src = t[end:end + k].tolist()
    return (src * -(-k // len(src)))[:k]  # cyclic: the overlapping copy of period size - end


class NgramDrafter(Drafter):
    """Prompt-lookup drafts (see the module docstring).

    Args:
        n: longest suffix matched (tokens).
        window: tokens searched, counted back from the last one.
        max_len: the engine's max_context_len (a request never holds more tokens).
    """

    def __init__(self, *, n: int = 3, window: int = 1024, max_len: int = 2048) -> None:
        self.n = n
        self.window = window
        self.max_len = max_len
        self.name = "ngram"
        self._tokens: dict[int, _Tokens] = {}

    def propose(self, requests: Sequence[Request], k: int) -> Drafts:
        if len(self._tokens) > len(requests):  # requests that left without a release (aborted)
            live = {r.rid for r in requests}
            for rid in [rid for rid in self._tokens if rid not in live]:
                del self._tokens[rid]
        out = []
        for r in requests:
            st = self._tokens.get(r.rid)
            if st is None:
                st = self._tokens[r.rid] = _Tokens()
            out.append(lookup(st.sync(r), self.n, k, self.window))
        return Drafts(out)

    def release(self, rid: int) -> None:
        self._tokens.pop(rid, None)

    def close(self) -> None:
        self._tokens.clear()
