"""One patch: transformers' sdpa attention on packed sequences attends within each sample (CPU runs).

verl's engines remove padding (`use_remove_padding`, verl's default): a micro-batch's samples are
packed into one sequence of S tokens whose position ids restart at 0 for each sample. On GPUs verl
runs flash-attention's varlen kernel on it, whose cost grows with the sum of the samples' squared
lengths. On CPU the model runs sdpa, and transformers gives it the packed sequence with an S x S
block-diagonal mask: attention over all S tokens, quadratic in the micro-batch's size (half the train
rank's time on the lookup demo: 6,000 packed tokens of 47-token samples). This wraps transformers'
sdpa attention: for a packed sequence it lays the samples out as a padded batch, runs sdpa causally
and packs the output back, the same result at the cost of varlen attention. Anything else (a batch
of several rows, decoding with a cache, a sliding window, 3-D position ids, a sequence-parallel
rank's slice, which `ulysses_sdpa` gathers first) is transformers' function, unchanged. For the
model types of PACKED_MASK_MODEL_TYPES it also stops transformers from building the S x S mask that
the wrapper does not read (a quarter of the train rank's time after the first fix). Tested in
tests/verl_patches/test_packed_sdpa.py.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

_MARK = "_async_rl_packed_sdpa"
# model types whose layers get the 2-D position ids their mask is built from (multimodal rope does not)
PACKED_MASK_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama", "mistral"})


class PackedLayout(NamedTuple):
    """Where each of a packed sequence's S tokens goes in a (samples, longest, ...) padded batch."""

    flat_index: torch.Tensor  # (S,) long: sample * longest + offset within the sample
    samples: int
    longest: int


def packed_layout(position_ids: torch.Tensor | None, length: int) -> PackedLayout | None:
    """The layout of a packed sequence of `length` tokens from its (1, length) position ids; a sample starts
    wherever a position does not follow the one before (transformers' `find_packed_sequence_indices` rule).
    None if they do not describe two samples or more."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape != (1, length) or length < 2:
        return None
    positions = position_ids[0]
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[1:] = torch.diff(positions) != 1
    first_token = torch.nonzero(starts).flatten()
    if first_token.numel() < 2:
        return None
    sample = torch.cumsum(starts.long(), dim=0) - 1
    offset = torch.arange(length, device=positions.device) - first_token[sample]
    longest = int(offset.max()) + 1
    return PackedLayout(sample * longest + offset, int(first_token.numel()), longest)


def to_padded(packed: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """(1, heads, S, dim) -> (samples, heads, longest, dim), zeros after each sample's end."""
    tokens = packed[0].transpose(0, 1)  # (S, heads, dim)
    padded = tokens.new_zeros(layout.samples * layout.longest, *tokens.shape[1:])
    padded = padded.index_copy(0, layout.flat_index, tokens)
    return padded.view(layout.samples, layout.longest, *tokens.shape[1:]).transpose(1, 2)


def handles(query: torch.Tensor, key: torch.Tensor, sliding_window) -> bool:
    """Whether the wrapper takes this call: one row, no cache, no sliding window, the whole sequence here."""
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size

    # a sequence-parallel rank holds a slice of the packed sequence: Ulysses' wrapper gathers it first
    return (query.shape[0] == 1 and query.shape[2] == key.shape[2] and sliding_window is None
            and get_ulysses_sequence_parallel_world_size() <= 1)


def packed_sdpa(original):
    """transformers' `sdpa_attention_forward(module, query, key, value, attention_mask, ...)` wrapped:
    query / key / value (1, heads, S, head_dim) of a packed sequence in, (1, S, heads, head_dim) out,
    each token attending causally within its own sample."""

    @functools.wraps(original)
    def forward(module, query, key, value, attention_mask, *args, position_ids=None, **kwargs):
        take = handles(query, key, kwargs.get("sliding_window"))
        layout = packed_layout(position_ids, query.shape[2]) if take else None
        if layout is None:
            return original(module, query, key, value, attention_mask, *args, position_ids=position_ids, **kwargs)
        kwargs.pop("is_causal", None)
        padded = [to_padded(t, layout) for t in (query, key, value)]
        output, weights = original(module, *padded, None, *args, is_causal=True, **kwargs)
        # output: (samples, longest, heads, dim) -> the packed tokens' rows, in order
        packed = output.reshape(layout.samples * layout.longest, *output.shape[2:]).index_select(0, layout.flat_index)
        return packed.unsqueeze(0), weights

    setattr(forward, _MARK, True)
    return forward


def without_packed_mask(original):
    """transformers' `masking_utils._preprocess_mask_arguments` wrapped: where sdpa is this wrapper's, the
    model is one of PACKED_MASK_MODEL_TYPES without a sliding window, a packed sequence of one row gets no
    packed-sequence mask, so no S x S mask is built (the wrapper keeps each sample to itself)."""

    @functools.wraps(original)
    def preprocess(config, inputs_embeds, *args, **kwargs):
        result = original(config, inputs_embeds, *args, **kwargs)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size

        packed = result[2] is not None and inputs_embeds.shape[0] == 1
        ours = (getattr(config, "_attn_implementation", None) == "sdpa"
                and getattr(config, "model_type", None) in PACKED_MASK_MODEL_TYPES
                and getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], _MARK, False))
        if (packed and ours and getattr(config, "sliding_window", None) is None
                and get_ulysses_sequence_parallel_world_size() <= 1):
            return (*result[:2], None, *result[3:])
        return result

    setattr(preprocess, _MARK, True)
    return preprocess


def patch_packed_sdpa() -> None:
    """Install the attention wrapper in transformers' registry and the mask wrapper (idempotent)."""
    import transformers.masking_utils as masking_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], _MARK, False):
        ALL_ATTENTION_FUNCTIONS["sdpa"] = packed_sdpa(ALL_ATTENTION_FUNCTIONS["sdpa"])
    if not getattr(masking_utils._preprocess_mask_arguments, _MARK, False):
        masking_utils._preprocess_mask_arguments = without_packed_mask(masking_utils._preprocess_mask_arguments)
