"""One patch: verl's log-probs of labels computed a block of rows at a time, not a row at a time (CPU runs).

Without flash-attention's cross-entropy (CPU), verl's `logprobs_from_logits` calls
`logprobs_from_logits_v2`, which loops over the logits' first dimension to bound peak memory. With
padding removed that dimension is the packed tokens: one `logsumexp` call per token from Python (a
fifth of the train rank's time on the lookup demo). This computes the same values over blocks of rows
holding at most ROW_BLOCK_ELEMENTS logits each: the same bound on peak memory, a few calls instead of
thousands. Tested in tests/verl_patches/test_row_block_logprobs.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_BLOCK_ELEMENTS = 1 << 24  # logits a block: 64 MiB in float32
_MARK = "_async_rl_row_block_logprobs"


def logprobs_in_row_blocks(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label): logits (..., vocab), labels (...) -> (...), as verl's `logprobs_from_logits_v2`
    (logsumexp in float32 / float64, log_softmax otherwise)."""
    rows = max(1, ROW_BLOCK_ELEMENTS // max(1, logits[0].numel())) if logits.dim() > 1 else len(logits)
    if logits.dtype in (torch.float32, torch.float64):
        label_logits = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
        return label_logits - torch.cat([torch.logsumexp(block, dim=-1) for block in logits.split(rows)])
    return torch.cat([F.log_softmax(block, dim=-1).gather(dim=-1, index=block_labels.unsqueeze(-1)).squeeze(-1)
                      for block, block_labels in zip(logits.split(rows), labels.split(rows), strict=True)])


setattr(logprobs_in_row_blocks, _MARK, True)


def patch_row_block_logprobs() -> None:
    """Make verl's `logprobs_from_logits` use `logprobs_in_row_blocks` (idempotent)."""
    import verl.utils.torch_functional as torch_functional

    if not getattr(torch_functional.logprobs_from_logits_v2, _MARK, False):
        logprobs_in_row_blocks.__wrapped__ = torch_functional.logprobs_from_logits_v2
        torch_functional.logprobs_from_logits_v2 = logprobs_in_row_blocks
