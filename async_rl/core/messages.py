"""What the stages send each other, in the order of the stage graph, and the verl batch they build.

    dataloader --PromptBatch--> generate --GeneratedBatch--> rollout --RolloutBatch--> reward, logp,
    ref_logp, values --ScoredBatch, LogpResult, RefLogpResult, ValuesResult--> actor_train
    --NewWeights--> param_update;  actor_train --CriticBatch--> critic_train

Every message carries its batch `index` (the training step's batch, 0-based). Batches travel by
reference (`batch_ref`: a `ray.ObjectRef` to a verl `DataProto`, or the DataProto itself), put
once into Ray's object store by the rollout stage.

`build_batch` lays samples out as verl does: prompts left-padded to `max_prompt_length`,
responses right-padded to `max_response_length`, `input_ids = prompts ++ responses`, with
`attention_mask`, `position_ids` and `response_mask` (1 on the model's tokens; 0 on padding and
on the tool/environment tokens of a multi-turn trajectory); the rollout's log-probs and the policy
version of each response token ride along as `rollout_log_probs` and `token_versions` (-1 on
padding and on tool/environment tokens). A multimodal sample (a vision-language model with
multimodal RoPE, e.g. Qwen2-VL) also carries verl's `multi_modal_inputs` among its non-tensor
columns and its three RoPE rows; its batch's `position_ids` are then verl's (bs, 4, seq_len): the
text positions, then the three RoPE rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

if TYPE_CHECKING:
    from verl import DataProto


TURNS_INTERRUPTED = "turns_interrupted"  # non-tensor column: turns of a trajectory a weight load (or a lost
# server) split, by agent-loop trajectory
TOOL_POOL_WAIT = "tool_pool_wait_s"  # non-tensor column: seconds a trajectory's tool calls waited for a free
# environment (`multi_turn.tool_pool_size`)
# non-tensor columns: seconds an agent-loop trajectory spent generating and in tool calls (verl's
# AgentLoopMetrics), logged as verl's `agent_loop/<name>/{min,max,mean}`
AGENT_LOOP_TIMINGS = {"generate_sequences": "agent_loop_generate_s", "tool_calls": "agent_loop_tool_calls_s"}
MULTI_MODAL_INPUTS = "multi_modal_inputs"  # non-tensor column (verl's): a row's processor outputs for the model's
# forward (pixel_values, image_grid_thw, ...), which the engines read beside input_ids
ROPE_ROWS = 3  # multimodal RoPE's rows (temporal, height, width), verl's position_ids rows 1-3


@dataclass
class PromptBatch:
    """Prompts of one training step (`index` = the step's batch index, 0-based)."""

    index: int
    non_tensor: list[dict[str, Any]] = field(default_factory=list)  # each prompt's dataset row, tensors aside


@dataclass
class Sample:
    """One generated response to one prompt (one member of a GRPO group)."""

    uid: str  # prompt-group id: samples of one prompt share it
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_log_probs: list[float]
    token_versions: list[int]  # policy version that produced each response token
    non_tensor: dict[str, Any] = field(default_factory=dict)  # data_source, reward_model, ...
    score: float | None = None  # filled by the reward stage
    response_mask: list[int] | None = None  # 1: a model token, 0: a tool/environment token (None: all 1)
    # multimodal RoPE: ROPE_ROWS rows of positions over prompt_ids + response_ids (None: text positions only)
    rope_position_ids: list[list[int]] | None = None
    # distillation: the teacher's ids and log-probs over prompt_ids + response_ids, (tokens, K) int32 and
    # float32 tensors in vLLM's prompt-logprob layout (async_rl/rollout/cpu/prompt_logprobs.py); None: no teacher
    teacher_ids: Any = None
    teacher_logprobs: Any = None


def build_batch(samples: list[Sample], max_prompt_length: int, max_response_length: int, pad_token_id: int) -> DataProto:
    """Stack samples into a padded `DataProto` (verl's prompt/response layout)."""
    from verl import DataProto  # here: `import verl` costs a stage that only passes messages on seconds of start

    n = len(samples)
    prompts = torch.full((n, max_prompt_length), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((n, max_prompt_length), dtype=torch.long)
    responses = torch.full((n, max_response_length), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((n, max_response_length), dtype=torch.long)  # model tokens
    response_attention = torch.zeros((n, max_response_length), dtype=torch.long)  # every response token
    rollout_log_probs = torch.zeros((n, max_response_length), dtype=torch.float32)
    token_versions = torch.full((n, max_response_length), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        p = s.prompt_ids[-max_prompt_length:]
        r = s.response_ids[:max_response_length]
        if p:
            prompts[i, -len(p) :] = torch.tensor(p)
            prompt_mask[i, -len(p) :] = 1
        if r:
            responses[i, : len(r)] = torch.tensor(r)
            response_attention[i, : len(r)] = 1
            response_mask[i, : len(r)] = torch.tensor(s.response_mask[: len(r)]) if s.response_mask is not None else 1
            rollout_log_probs[i, : len(r)] = torch.tensor(s.rollout_log_probs[: len(r)], dtype=torch.float32)
            token_versions[i, : len(r)] = torch.tensor(s.token_versions[: len(r)])
    attention_mask = torch.cat([prompt_mask, response_attention], dim=1)
    position_ids = torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0)
    with_rope = [s.rope_position_ids is not None for s in samples]
    if any(with_rope):
        if not all(with_rope):
            raise ValueError("a batch mixes samples with multimodal RoPE positions and samples without")
        position_ids = _with_rope_rows(samples, position_ids, max_prompt_length, max_response_length)
    tensors = {}
    with_teacher = [s.teacher_ids is not None for s in samples]
    if any(with_teacher):
        if not all(with_teacher):
            raise ValueError("a batch mixes samples scored by a distillation teacher and samples that were not")
        tensors["teacher_ids"] = _token_aligned([s.teacher_ids for s in samples], samples, pad_token_id,
                                                max_prompt_length, max_response_length)
        tensors["teacher_logprobs"] = _token_aligned([s.teacher_logprobs for s in samples], samples, 0.0,
                                                     max_prompt_length, max_response_length)
    tensors.update({
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "rollout_log_probs": rollout_log_probs,
        "token_versions": token_versions,
    })
    keys = sorted({k for s in samples for k in s.non_tensor})
    non_tensors = {k: object_column([s.non_tensor.get(k) for s in samples]) for k in keys}
    non_tensors["uid"] = object_column([s.uid for s in samples])
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


def _token_aligned(per_sample: list, samples: list[Sample], fill, max_prompt_length: int,
                   max_response_length: int) -> torch.Tensor:
    """(n, prompt + response width, ...): each sample's per-token values (its `per_sample` entry, a tensor of
    (prompt + response tokens, ...)) laid out as its tokens are, truncated the same way; `fill` elsewhere."""
    first = torch.as_tensor(per_sample[0])
    out = torch.full((len(samples), max_prompt_length + max_response_length, *first.shape[1:]), fill,
                     dtype=first.dtype)
    for i, (s, values) in enumerate(zip(samples, per_sample, strict=True)):
        values = torch.as_tensor(values)
        if values.shape[0] != len(s.prompt_ids) + len(s.response_ids):
            raise ValueError(f"sample {s.uid}: {values.shape[0]} per-token values for "
                             f"{len(s.prompt_ids)} prompt and {len(s.response_ids)} response tokens")
        p = min(len(s.prompt_ids), max_prompt_length)
        r = min(len(s.response_ids), max_response_length)
        out[i, max_prompt_length - p : max_prompt_length] = values[len(s.prompt_ids) - p : len(s.prompt_ids)]
        out[i, max_prompt_length : max_prompt_length + r] = values[len(s.prompt_ids) : len(s.prompt_ids) + r]
    return out


def _with_rope_rows(samples: list[Sample], text_positions: torch.Tensor, max_prompt_length: int,
                    max_response_length: int) -> torch.Tensor:
    """(n, 1 + ROPE_ROWS, prompt + response width): `text_positions` (n, width), then each sample's RoPE rows
    laid out as its tokens are (truncated the same way); 1 under padding, as transformers' `get_rope_index`."""
    rows = [torch.tensor(s.rope_position_ids, dtype=torch.long) for s in samples]
    for s, r in zip(samples, rows, strict=True):
        if r.shape != (ROPE_ROWS, len(s.prompt_ids) + len(s.response_ids)):
            raise ValueError(f"sample {s.uid}: RoPE rows of shape {tuple(r.shape)} for "
                             f"{len(s.prompt_ids)} prompt and {len(s.response_ids)} response tokens")
    rope = _token_aligned([r.T for r in rows], samples, 1, max_prompt_length, max_response_length)
    return torch.cat([text_positions.unsqueeze(1), rope.transpose(1, 2)], dim=1)


def response_lengths(batch) -> torch.Tensor:
    """(bs,) tokens of each response before its padding: the model's and, in a multi-turn trajectory,
    the tools' (the attention mask's response part, as verl's reward managers count them)."""
    width = batch.batch["responses"].shape[1]
    return batch.batch["attention_mask"][:, -width:].sum(-1)


def object_column(values: list) -> np.ndarray:
    """A 1-D object array of `values` (list values stay elements, never a second axis)."""
    column = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        column[i] = value
    return column


@dataclass
class GeneratedBatch:
    """All samples of one step: `n` responses for each prompt of the PromptBatch."""

    index: int
    samples: list[Sample]
    start_version: int  # version served when the batch was admitted
    baselines: list[Sample] = field(default_factory=list)  # ReMax: one greedy sample per prompt (not trained)


async def resolve(value):
    """The object behind a `ray.ObjectRef`, or `value` itself."""
    import ray  # here, so that the weight path's modules import on a machine without Ray

    return await value if isinstance(value, ray.ObjectRef) else value


@dataclass
class RolloutBatch:
    """One step's padded batch, by reference (`ray.ObjectRef` to a DataProto, or the DataProto)."""

    index: int
    batch_ref: Any
    start_version: int
    baseline_ref: Any = None  # ReMax: the greedy samples' DataProto, by reference (the reward stage scores it)

    async def get(self):
        return await resolve(self.batch_ref)


@dataclass
class ScoredBatch:
    """Per-sample scores of one step's batch (sequence-level, placed on the last token later).

    Stages between reward and actor_train may set `keep` to train on a subset of rows
    (actor_train still logs data metrics over every row) and add step `metrics`.
    """

    index: int
    scores: torch.Tensor  # (bs,) float32
    uids: np.ndarray  # (bs,) prompt-group id of each row (samples of one prompt share it)
    keep: Optional[torch.Tensor] = None  # (bs,) bool: rows to train on; None = all
    metrics: dict = field(default_factory=dict)  # merged into the step's logged metrics
    batch_ref: Any = None  # the scored DataProto, by reference (for stages that regroup rows)
    baselines: Optional[torch.Tensor] = None  # (bs,) ReMax: the score of each row's prompt's greedy sample


@dataclass
class TrainingBatch(RolloutBatch):
    """A training batch formed by dynamic sampling: what logp / ref_logp compute on, and its rewards."""

    scored: Optional[ScoredBatch] = None


@dataclass
class LogpResult:
    index: int
    batch_ref: Any  # the step's DataProto, by reference (from RolloutBatch)
    old_log_probs: Optional[torch.Tensor]  # (bs, response_len); None when not computed (bypass mode)
    logp_version: int  # policy version of the weights that computed them (-1: none)


@dataclass
class RefLogpResult:
    index: int
    ref_log_prob: Optional[torch.Tensor]  # (bs, response_len), None without a reference policy


@dataclass
class ValuesResult:
    index: int
    values: torch.Tensor  # (bs, response_len), fp32
    critic_version: int  # the critic version that computed them
    seconds: float  # the critic's forward (verl's timing_s/values)


@dataclass
class CriticBatch:
    """What actor_train sends after the advantages of batch `index`: the rows to train, with
    `values` and GAE's `returns` (a DataProto, by reference; None: every row was filtered out)."""

    index: int
    batch_ref: Any


@dataclass
class NewWeights:
    """Version `version` is on its way to param_update (its buckets arrive through `put_bucket`)."""

    version: int
    started_at: float  # wall time (time.time()) when its gather began
