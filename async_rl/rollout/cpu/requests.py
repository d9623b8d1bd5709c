"""One request in the CPU engine: its state while live and the result it returns."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Optional

import torch

from async_rl.rollout.cpu.sampling import SamplingOptions

STOP_COMPLETED = "completed"
STOP_ABORTED = "aborted"
STOP_LENGTH = "length"


@dataclass
class GenerationResult:
    """Output of one request.

    ``log_probs[i]`` is ``log_softmax(logits / T)[token_ids[i]]`` (``T = 1`` for greedy);
    ``token_versions[i]`` is the weight version that produced ``token_ids[i]``;
    ``stop_reason`` is "completed" (eos/stop token), "length" (``max_new_tokens`` or
    ``max_model_len`` reached) or "aborted".
    """

    request_id: str
    token_ids: list[int]
    log_probs: list[float]
    token_versions: list[int]
    stop_reason: str


@dataclass(eq=False)
class SequenceState:
    """A live request: its prompt and options, its tokens so far, and the future its caller awaits."""

    request_id: str
    prompt_ids: list[int]
    opts: SamplingOptions
    future: asyncio.Future
    max_len: int  # total (prompt + generated) length at which generation stops
    out_ids: list[int] = field(default_factory=list)
    out_logps: list[float] = field(default_factory=list)
    out_versions: list[int] = field(default_factory=list)
    done: bool = False
    vision_inputs: Optional[dict[str, torch.Tensor]] = None  # the images' processor outputs (pixel_values, ...)
    rope_delta: int = 0  # multimodal RoPE: a token's position minus its index (set at prefill)
    arrived_s: float = 0.0  # when it was submitted, on the engine's event-loop clock (s)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.out_ids

    def result(self, stop_reason: str) -> GenerationResult:
        return GenerationResult(
            request_id=self.request_id,
            token_ids=list(self.out_ids),
            log_probs=list(self.out_logps),
            token_versions=list(self.out_versions),
            stop_reason=stop_reason,
        )
