"""Sampling for the CPU engine: per-request settings and one sampled token per batch row.

Log-probs: for a sampled token ``t`` with temperature ``T > 0`` the engine
returns ``log_softmax(logits / T)[t]`` of the raw model logits: the policy at
temperature ``T``, the same quantity verl's actor computes with
``temperature=T``. top-k / top-p restrict *which* tokens can be sampled but are
not folded into the returned log-prob. Greedy requests (``temperature == 0``)
return ``log_softmax(logits)[t]`` (temperature 1).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

# Sampling-param keys that are accepted and have no effect here (detokenization options; log-probs are always on).
_NO_EFFECT_KEYS = frozenset({"logprobs", "skip_special_tokens", "spaces_between_special_tokens", "detokenize"})
# Keys this engine cannot honour unless they hold their neutral value (key -> neutral value).
_UNSUPPORTED_NEUTRAL = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_p": 0.0,
    "n": 1,
}
_warned_keys: set[str] = set()  # unknown sampling keys already warned about (warn once per key)


@dataclass(frozen=True)
class SamplingOptions:
    """Per-request sampling settings.

    ``temperature`` 0 means greedy; ``top_k`` <= 0 and ``top_p`` >= 1 disable the
    filters; ``max_new_tokens`` counts generated tokens; generation also stops after
    any of ``stop_token_ids`` (the token is kept in the output).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @classmethod
    def from_params(cls, params: Optional[Mapping[str, Any]], default_max_new_tokens: int = 16) -> SamplingOptions:
        """Build from a vLLM/SGLang-style dict (``max_new_tokens`` or ``max_tokens``).

        Raises ValueError for settings this engine cannot honour (e.g. ``repetition_penalty != 1``);
        unknown keys are ignored with a warning.
        """
        params = dict(params or {})
        max_new = params.pop("max_new_tokens", None)
        max_tokens = params.pop("max_tokens", None)
        if max_new is None:
            max_new = max_tokens if max_tokens is not None else default_max_new_tokens
        stop = set(params.pop("stop_token_ids", None) or ())
        opts = cls(
            temperature=float(params.pop("temperature", 1.0)),
            top_p=float(params.pop("top_p", 1.0)),
            top_k=int(-1 if (top_k := params.pop("top_k", None)) is None else top_k),
            max_new_tokens=max(0, int(max_new)),
            stop_token_ids=frozenset(int(t) for t in stop),
            ignore_eos=bool(params.pop("ignore_eos", False)),
        )
        if opts.temperature < 0 or not math.isfinite(opts.temperature):
            raise ValueError(f"temperature must be >= 0, got {opts.temperature}")
        if not 0.0 < opts.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {opts.top_p}")
        for key, neutral in _UNSUPPORTED_NEUTRAL.items():
            value = params.pop(key, None)
            if value is not None and float(value) != neutral:
                raise ValueError(f"sampling param {key}={value} is not supported by the CPU engine")
        for key in set(params) - _NO_EFFECT_KEYS - _warned_keys:
            _warned_keys.add(key)
            logger.warning("CPU engine ignores sampling param %r (e.g. %r)", key, params[key])
        return opts


def sample_tokens(
    logits: torch.Tensor, opts: list[SamplingOptions], generator: torch.Generator
) -> tuple[list[int], list[float]]:
    """Sample one token per row of ``logits`` ``[rows, vocab]``; return tokens and their log-probs."""
    temps = torch.tensor([o.temperature if o.temperature > 0 else 1.0 for o in opts], dtype=logits.dtype)
    scaled = logits / temps[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)

    filtered = scaled
    vocab = logits.shape[-1]
    top_ks = [o.top_k if 0 < o.top_k < vocab else vocab for o in opts]
    if any(k < vocab for k in top_ks):
        k = torch.tensor(top_ks)
        kth = torch.sort(filtered, dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if any(o.top_p < 1.0 for o in opts):
        top_p = torch.tensor([o.top_p for o in opts], dtype=logits.dtype)
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))

    sampled = torch.multinomial(torch.softmax(filtered, dim=-1), 1, generator=generator).squeeze(-1)
    greedy = torch.tensor([o.greedy for o in opts])
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    token_logprobs = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens.tolist(), token_logprobs.tolist()

