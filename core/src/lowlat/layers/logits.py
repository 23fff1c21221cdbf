"""Logits: pick the rows a step returns, project with the (vocab-parallel) LM head, gather the full vocab.

Output convention (``lowlat.forward_batch``): float32 ``[R, vocab]``, R = T for DECODE and VERIFY
(every new token), R = B for PREFILL (the last new token of each request). The matmul runs in the model dtype
and the result is cast to float32 afterwards, as HF's ``LlamaForCausalLM`` + ``generate`` do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowlat.distributed import TPInfo, all_gather_last_dim
from lowlat.forward_batch import ForwardBatch, ForwardMode


def logit_rows(hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """hidden [T, H] -> [R, H]: all rows, or for PREFILL the last new token of each request.

    The PREFILL index ``extend_start_loc + extend_lens - 1`` is computed on the device (no host sync).
    """
    if batch.forward_mode is not ForwardMode.PREFILL:
        return hidden
    last = (batch.extend_start_loc + batch.extend_lens - 1).to(torch.int64)
    return hidden.index_select(0, last)


def compute_logits(hidden: torch.Tensor, lm_head_weight: torch.Tensor, vocab_size: int,
                   tp: TPInfo) -> torch.Tensor:
    """hidden [R, H] (final-normed), lm_head_weight [V_l, H] -> float32 [R, vocab_size], full vocab on each rank."""
    logits = F.linear(hidden, lm_head_weight).float()
    logits = all_gather_last_dim(logits, tp)
    return logits[:, :vocab_size] if logits.shape[1] != vocab_size else logits
