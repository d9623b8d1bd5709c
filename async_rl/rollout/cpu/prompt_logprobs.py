"""Prompt log-probs as vLLM's servers hand them to verl (`extract_prompt_logprobs`): row i of an S-token
sequence is the model's distribution after tokens 0..i, scored on token i + 1; the last row is padding.

With `top_k` 0 a row holds the log-prob of the token that follows and that token's id; with `top_k` K > 0 it
holds the K most likely next tokens (ids and log-probs, most likely first). verl's distillation reads them as
the teacher's (`teacher_ids`, `teacher_logprobs`).
"""

from __future__ import annotations

import torch


@torch.no_grad()
def prompt_logprobs(model, token_ids: list[int], top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (S, max(top_k, 1)) int32, log-probs (S, max(top_k, 1)) float32) of `token_ids` (S tokens) under
    `model` (a causal LM), in vLLM's layout (module docstring); the last row is zeros."""
    if top_k < 0:
        raise ValueError(f"prompt_logprobs must be >= 0, got {top_k}")
    ids = torch.tensor([token_ids], dtype=torch.long)
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    if top_k == 0:
        next_ids = ids[0, 1:].unsqueeze(-1)
        rows_ids, rows_logprobs = next_ids, log_probs.gather(-1, next_ids)
    else:
        rows_logprobs, rows_ids = log_probs.topk(top_k, dim=-1)
    width = max(top_k, 1)
    out_ids = torch.zeros((len(token_ids), width), dtype=torch.int32)
    out_logprobs = torch.zeros((len(token_ids), width), dtype=torch.float32)
    out_ids[:-1] = rows_ids.to(torch.int32)
    out_logprobs[:-1] = rows_logprobs
    return out_ids, out_logprobs
