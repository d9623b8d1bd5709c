"""One patch: verl 0.9.1's Ulysses sequence parallelism with transformers' sdpa attention (CPU runs).

verl splits each packed sequence across the `ulysses_sequence_parallel_size` ranks of a group and
patches flash-attention's forward with the all-to-all that gives every rank the whole sequence for
its share of the heads (`verl/models/transformers/monkey_patch.py`). On CPU the model runs sdpa, which
that patch never reaches: each rank would attend within its own slice of the sequence. This wraps
transformers' sdpa attention the same way: with a sequence-parallel group of more than one rank, the
query, key and value are gathered along the sequence and scattered along the heads (verl's
`gather_seq_scatter_heads`), attention runs over the whole packed sequence under a causal mask that
keeps each packed sample to itself (its positions restart at 0, as verl packs them), and the output
goes back (verl's `gather_heads_scatter_seq`). With no such group it is transformers' function,
unchanged. Tested in tests/verl_patches/test_ulysses_sdpa.py (two gloo ranks: the same output and
gradients as one rank on the whole sequence; wrong without the patch).
"""

from __future__ import annotations

import functools

import torch

_MARK = "_async_rl_ulysses_sdpa"


def packed_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(1, 1, S, S) bool: token i attends to token j <= i of the same packed sample (a sample starts where
    its position id is 0). `position_ids`: (1, S)."""
    positions = position_ids.reshape(-1)
    sample = torch.cumsum((positions == 0).long(), dim=0)
    same = sample[:, None] == sample[None, :]
    causal = torch.ones(len(positions), len(positions), dtype=torch.bool, device=positions.device).tril()
    return (same & causal)[None, None]


def ulysses_sdpa(original):
    """transformers' `sdpa_attention_forward(module, query, key, value, attention_mask, ...)` wrapped for
    Ulysses: query / key / value (batch, heads, S / sp, head_dim) in, (batch, S / sp, heads, head_dim) out."""
    from verl.utils.ulysses import (gather_heads_scatter_seq, gather_seq_scatter_heads,
                                    get_ulysses_sequence_parallel_group, get_ulysses_sequence_parallel_world_size)

    @functools.wraps(original)
    def forward(module, query, key, value, attention_mask, *args, position_ids=None, **kwargs):
        sp = get_ulysses_sequence_parallel_world_size()
        if sp <= 1 or position_ids is None:
            return original(module, query, key, value, attention_mask, *args, position_ids=position_ids, **kwargs)
        repeats = max(sp // key.size(1), 1)  # as verl: enough kv heads to scatter
        key, value = (t.repeat_interleave(repeats, dim=1) for t in (key, value))
        query, key, value = (gather_seq_scatter_heads(t, seq_dim=2, head_dim=1) for t in (query, key, value))
        gathered = [torch.empty_like(position_ids) for _ in range(sp)]
        torch.distributed.all_gather(gathered, position_ids.contiguous(), group=get_ulysses_sequence_parallel_group())
        mask = packed_causal_mask(torch.cat(gathered, dim=-1))
        kwargs.pop("is_causal", None)
        output, weights = original(module, query, key, value, mask, *args, is_causal=False, **kwargs)
        return gather_heads_scatter_seq(output, seq_dim=1, head_dim=2), weights

    setattr(forward, _MARK, True)
    return forward


def patch_ulysses_sdpa() -> None:
    """Install the wrapper in transformers' attention registry (idempotent)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], _MARK, False):
        return
    ALL_ATTENTION_FUNCTIONS["sdpa"] = ulysses_sdpa(ALL_ATTENTION_FUNCTIONS["sdpa"])
