"""The CPU engine's running batch and its KV cache, and the two forwards that fill it.

The KV cache is one ``transformers.DynamicCache`` for the whole batch, left
padded: rows share the column layout, a 2-D attention mask hides the padding
and ``position_ids`` are given per row, so padding never shifts RoPE positions.
Only models whose layers are all full attention are supported (Qwen2/Qwen3,
Llama, ...); sliding-window or linear-attention layers are rejected when the
engine is built.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers import DynamicCache, PreTrainedModel

from async_rl.rollout.cpu.requests import SequenceState
from async_rl.rollout.cpu.vision import MultimodalRope


class KVBatch:
    """Rows of the running batch: sequences, their left-padded KV cache and attention mask.

    Invariant: the cache holds every token of each row except the last one in ``seq.all_ids``,
    which is the next decode step's input. ``mask`` is ``[rows, cache_len]`` (1 = real token).
    """

    def __init__(self, seqs: list[SequenceState], cache: Optional[DynamicCache], mask: torch.Tensor):
        self.seqs = seqs
        self.cache = cache
        self.mask = mask

    @classmethod
    def empty(cls) -> KVBatch:
        return cls([], None, torch.zeros(0, 0, dtype=torch.long))

    def __len__(self) -> int:
        return len(self.seqs)

    def _layers(self):
        return self.cache.layers if self.cache is not None else []

    def select(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order) and drop leading all-padding columns."""
        if not rows:
            self.seqs, self.cache, self.mask = [], None, torch.zeros(0, 0, dtype=torch.long)
            return
        index = torch.tensor(rows, dtype=torch.long)
        self.seqs = [self.seqs[i] for i in rows]
        self.mask = self.mask[index]
        used = self.mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else self.mask.shape[1]
        self.mask = self.mask[:, start:]
        for layer in self._layers():
            layer.keys = layer.keys[index, :, start:]
            layer.values = layer.values[index, :, start:]

    def extend(self, other: KVBatch) -> None:
        """Append ``other``'s rows, left-padding whichever cache is shorter."""
        if len(other) == 0:
            return
        if len(self) == 0:
            self.seqs, self.cache, self.mask = other.seqs, other.cache, other.mask
            return
        width = max(self.mask.shape[1], other.mask.shape[1])

        def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - t.shape[dim]
            if missing == 0:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        for mine, theirs in zip(self._layers(), other._layers(), strict=True):
            mine.keys = torch.cat([pad(mine.keys, 2), pad(theirs.keys, 2)], dim=0)
            mine.values = torch.cat([pad(mine.values, 2), pad(theirs.values, 2)], dim=0)
        self.mask = torch.cat([pad(self.mask, 1), pad(other.mask, 1)], dim=0)
        self.seqs = self.seqs + other.seqs


def prefill_forward(model: PreTrainedModel, seqs: list[SequenceState], rope: Optional[MultimodalRope] = None
                    ) -> tuple[KVBatch, torch.Tensor]:
    """Forward the full token lists of ``seqs`` (left-padded) and return their cache and next-token logits;
    ``rope``: the model's multimodal RoPE (positions, and the rows' images).

    Once the sampled token is appended, the cache holds every token but the last (the batch invariant).
    """
    ids = [s.all_ids for s in seqs]
    width = max(len(x) for x in ids)
    input_ids = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    positions = torch.zeros(len(ids), width, dtype=torch.long)
    for row, x in enumerate(ids):
        input_ids[row, width - len(x) :] = torch.tensor(x)
        mask[row, width - len(x) :] = 1
        positions[row, width - len(x) :] = torch.arange(len(x))
    images = {}
    if rope is not None:
        positions, images = rope.prefill(seqs, positions)
    cache = DynamicCache()
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
        **images,
    )
    # Zero the padded slots: a padded query attends to nothing, and NaN/garbage computed there must
    # not reach later products (a masked weight of 0 times NaN is still NaN).
    pad = (mask == 0)[:, None, :, None]
    for layer in cache.layers:
        layer.keys = layer.keys.masked_fill(pad, 0.0)
        layer.values = layer.values.masked_fill(pad, 0.0)
    return KVBatch(list(seqs), cache, mask), out.logits[:, -1].float()


def decode_forward(model: PreTrainedModel, batch: KVBatch, rope: Optional[MultimodalRope] = None) -> torch.Tensor:
    """Forward the last token of every row against the cache (which grows by one column); next-token logits."""
    rows = len(batch)
    input_ids = torch.tensor([[s.all_ids[-1]] for s in batch.seqs], dtype=torch.long)
    positions = torch.tensor([[len(s.prompt_ids) + len(s.out_ids) - 1] for s in batch.seqs], dtype=torch.long)
    if rope is not None:
        positions = rope.decode(batch.seqs, positions)
    mask = torch.cat([batch.mask, torch.ones(rows, 1, dtype=torch.long)], dim=1)
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=batch.cache,
        use_cache=True,
    )
    batch.mask = mask
    return out.logits[:, -1].float()
