"""Images in the CPU engine, for models with multimodal RoPE (Qwen2-VL and its kind).

A request's images come as its processor outputs (`pixel_values`, `image_grid_thw`); its prompt holds
the image's tokens already expanded (verl's agent loops apply the processor). The prefill gives the
images to the model's forward and each row its three RoPE rows from the model's own `get_rope_index`;
the decode continues each row at its last position plus one (`rope_delta`: where the RoPE positions
of its text run ahead of, or behind, its token count). A text-only row is the same with delta 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch
from transformers import PreTrainedModel

from async_rl.core.messages import ROPE_ROWS
from async_rl.core.model_class import has_vision_tower
from async_rl.rollout.cpu.requests import SequenceState


class MultimodalRope:
    """The positions and image inputs of a model with multimodal RoPE; `for_model` gives None for others."""

    def __init__(self, model: PreTrainedModel):
        self._rope_index = model.model.get_rope_index
        self.image_token_id = int(model.config.image_token_id)
        self._merge = int(model.config.vision_config.spatial_merge_size)

    @classmethod
    def for_model(cls, model: PreTrainedModel) -> Optional[MultimodalRope]:
        inner = getattr(model, "model", None)
        if not has_vision_tower(model.config) or not hasattr(inner, "get_rope_index"):
            return None
        return cls(model)

    def check(self, prompt_ids: list[int], vision_inputs: Mapping[str, torch.Tensor]) -> None:
        """Raise ValueError unless the prompt holds exactly the image tokens its images fill."""
        grid = vision_inputs.get("image_grid_thw")
        if grid is None or "pixel_values" not in vision_inputs:
            raise ValueError(f"image inputs need pixel_values and image_grid_thw, got {sorted(vision_inputs)}")
        expected = int((grid.prod(-1) // self._merge**2).sum())
        found = sum(1 for t in prompt_ids if t == self.image_token_id)
        if found != expected:
            raise ValueError(f"the prompt has {found} image tokens, its {len(grid)} image(s) fill {expected}")

    def prefill(self, seqs: list[SequenceState], text_positions: torch.Tensor
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(ROPE_ROWS, rows, width) positions of left-padded rows: `text_positions` (rows, width) on each row
        without images, the model's `get_rope_index` on each with them (setting its `rope_delta`); and the
        images of the rows in row order for the forward (the model fills image tokens in that order)."""
        positions = text_positions.unsqueeze(0).repeat(ROPE_ROWS, 1, 1)
        width = text_positions.shape[1]
        for row, seq in enumerate(seqs):
            seq.rope_delta = 0
            if seq.vision_inputs is None:
                continue
            ids = torch.tensor([seq.all_ids])
            rows, delta = self._rope_index(input_ids=ids, mm_token_type_ids=(ids == self.image_token_id).long(),
                                           image_grid_thw=seq.vision_inputs["image_grid_thw"])
            positions[:, row, width - ids.shape[1]:] = rows[:, 0]
            seq.rope_delta = int(delta.flatten()[0])
        with_images = [s.vision_inputs for s in seqs if s.vision_inputs is not None]
        if not with_images:
            return positions, {}
        return positions, {key: torch.cat([inputs[key] for inputs in with_images])
                           for key in ("pixel_values", "image_grid_thw")}

    @staticmethod
    def decode(seqs: list[SequenceState], text_positions: torch.Tensor) -> torch.Tensor:
        """(ROPE_ROWS, rows, 1) positions of each row's last token: its text position (`text_positions`,
        (rows, 1)) plus its `rope_delta`."""
        deltas = torch.tensor([[s.rope_delta] for s in seqs], dtype=torch.long)
        return (text_positions + deltas).unsqueeze(0).expand(ROPE_ROWS, -1, -1)
