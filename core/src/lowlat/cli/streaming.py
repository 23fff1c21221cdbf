"""``stream_generate``: Engine.add_request + step() with text streamed per request and stop strings applied.

The loop ``lowlat run`` uses: each step's new tokens (``Engine.step_observer``) go through an
``IncrementalDetokenizer``; a completion that meets a stop string is aborted in the engine (its KV pages freed
before the next step) and ends with ``finish_reason="stop"`` and the text cut before the stop string.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from lowlat.runtime.engine import Completion
from lowlat.serve.detokenizer import IncrementalDetokenizer


def stream_generate(engine: Any, prompts: Sequence[str], params: Any, *, stop: Sequence[str] = (),
                    on_text: Callable[[int, str], None] | None = None) -> list[Completion]:
    """Generate every prompt (continuously batched); ``on_text(prompt index, text)`` gets each text delta.

    Returns one Completion per prompt, in prompt order; its ``text`` is the streamed text.
    """
    rids = [engine.add_request(p, params) for p in prompts]
    index = {rid: i for i, rid in enumerate(rids)}
    detoks = {rid: IncrementalDetokenizer(engine.tokenizer, stop) for rid in rids}
    seen = dict.fromkeys(rids, 0)
    stopped: dict[int, Any] = {}
    done: dict[int, Completion] = {}

    def observe(step: Any) -> None:
        for r in step.requests:
            d = detoks.get(r.rid)
            if d is None or d.stopped:
                continue
            new = r.output_ids[seen[r.rid]:]
            seen[r.rid] = len(r.output_ids)
            text = d.add(new)
            if r.finish_reason is not None or d.stopped:
                text += d.finish()
            if d.stopped and r.finish_reason is None:
                stopped[r.rid] = r
            if text and on_text is not None:
                on_text(index[r.rid], text)

    prev = engine.step_observer
    engine.step_observer = observe
    try:
        while engine.has_unfinished():
            for c in engine.step():
                c.text = detoks[c.request_id].text
                if detoks[c.request_id].stopped:
                    c.finish_reason = "stop"
                done[c.request_id] = c
            for rid, r in stopped.items():
                engine.abort(rid)
                done[rid] = _stopped(r, detoks[rid], time.perf_counter())
            stopped.clear()
    finally:
        engine.step_observer = prev
    return [done[r] for r in rids]


def _stopped(r: Any, detok: IncrementalDetokenizer, now: float) -> Completion:
    first = r.t_first_token or now
    return Completion(request_id=r.rid, prompt_token_ids=r.prompt_ids, token_ids=list(r.output_ids),
                      text=detok.text, finish_reason="stop", queue_s=(r.t_prefill_start or r.t_added) - r.t_added,
                      prefill_s=first - (r.t_prefill_start or first), decode_s=now - first)
