"""verl's agent loops (`verl.experimental.agent_loop`) run inside the generate stage.

Every sample, training and validation, goes through the agent loop verl would run for it: the
row's `agent_name`, else `actor_rollout_ref.rollout.agent.default_agent_loop`; loops come from
verl's registry (`single_turn_agent`, `tool_agent`, and those of
`rollout.agent.agent_loop_config_path`). verl's own `AgentLoopWorker` instantiates them and
post-processes their output (padding, `response_mask`, position ids, `__num_turns__`,
`turn_scores`, `tool_rewards`); the only piece that is the pipeline's is the LLM client the loops
call, `PipelineLLMClient`: its `generate` goes through the pipeline's replicas
(`async_rl.rollout.requests.generate_resumable`: a weight load that aborts a turn resumes it under
the new weights, a lost server is restarted and the turn resubmitted, a request timeout bounds it),
keeps a trajectory's turns on one replica (prefix cache), and records the weight version of every
model token of the trajectory. Tokens, never text: a loop's prompt tokens and each turn's tokens
go to the trainer exactly as the engine returned them.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import hydra
import numpy as np
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopWorker,
    DictConfigWrap,
    ToolListWrap,
    _agent_loop_registry,
)
from verl.tools.function_tool import FunctionTool
from verl.utils.rollout_trace import rollout_trace_attr, rollout_trace_op
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from async_rl.core.messages import AGENT_LOOP_TIMINGS, TOOL_POOL_WAIT, TURNS_INTERRUPTED, Sample, object_column
from async_rl.rollout.environment_pool import EnvironmentPool
from async_rl.rollout.requests import generate_resumable
from async_rl.rollout.routing import UserRouter
from async_rl.rollout.supervisor import ReplicaSupervisor

VERSIONS_FIELD = "token_versions"  # the per-trajectory versions, as the agent loop worker hands them back
TEACHER_KEYS = ("teacher_ids", "teacher_logprobs")  # verl's batch keys of a distillation teacher's scores


@dataclass
class TrajectoryRecord:
    """What one trajectory's generate calls produced, in call order."""

    versions: list[int] = field(default_factory=list)  # weight version of each model token
    turns: int = 0  # generate calls
    segments: int = 0  # segments over all calls (a weight load or a lost server ends one early)
    pool_wait_s: float = 0.0  # seconds its tool calls waited for a free environment (EnvironmentPool)
    sequence: Optional[list[int]] = None  # the last call's prompt + its tokens: the next call must extend it


_TRAJECTORY: contextvars.ContextVar[Optional[TrajectoryRecord]] = contextvars.ContextVar(
    "async_rl_trajectory", default=None)


class NonExtendingTurnError(ValueError):
    """An agent loop's turn whose prompt does not extend the trajectory's sequence so far."""


class PipelineLLMClient(LLMServerClient):
    """verl's LLM client interface for agent loops, served by the pipeline's replicas.

    `generate(request_id, prompt_ids=, sampling_params=)` returns verl's TokenOutput with the behaviour
    log-probs of every token, through `generate_resumable` on `servers` (a ReplicaSupervisor; each
    request bounded by `request_timeout_s`, s). Calls with the same `request_id` go to the same replica
    while it serves (the newest `sticky_entries` ids are remembered); with `router` (a user's load balancer,
    `rollout.router_config_path`: async_rl/rollout/routing.py) the router chooses each call's replica and is
    told when the call ends, as under verl's client. `max_tokens` defaults as verl's
    servers default it: min(response_length, prompt_length + response_length - len(prompt_ids)), at
    least 1. `served_version()`: the version the replicas serve now. Within one trajectory each call's
    prompt must extend the previous call's prompt + tokens, else NonExtendingTurnError.
    """

    def __init__(self, config, servers: ReplicaSupervisor, request_timeout_s: float,
                 served_version: Callable[[], int], sticky_entries: int = 10000,
                 router: Optional[UserRouter] = None):
        super().__init__(config, load_balancer_handle=router.handle if router is not None else None)
        self.router = router
        rollout = config.actor_rollout_ref.rollout
        self.prompt_length, self.response_length = int(rollout.prompt_length), int(rollout.response_length)
        self.servers, self.request_timeout_s, self.served_version = servers, request_timeout_s, served_version
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._sticky_entries = sticky_entries
        self._next = 0

    def _replica_for(self, request_id: str) -> int:
        if request_id in self._sticky:
            self._sticky.move_to_end(request_id)
            return self._sticky[request_id]
        index = self._next % len(self.servers.handles)
        self._next += 1
        self._sticky[request_id] = index
        if len(self._sticky) > self._sticky_entries:
            self._sticky.popitem(last=False)
        return index

    @rollout_trace_op  # a span per request under `rollout.trace.backend`, as verl's client has
    async def generate(self, request_id, *, prompt_ids, sampling_params, image_data=None, video_data=None,
                       audio_data=None, mm_processor_kwargs=None, **kwargs: Any) -> TokenOutput:
        if video_data or audio_data:
            raise NotImplementedError("the pipeline's agent-loop client takes images only (got video or audio data)")
        prompt_ids = [int(t) for t in prompt_ids]
        params = {k: v for k, v in dict(sampling_params).items() if k not in ("max_new_tokens", "max_tokens")}
        limit = sampling_params.get("max_tokens", sampling_params.get("max_new_tokens"))
        if limit is None:
            limit = min(self.response_length, self.prompt_length + self.response_length - len(prompt_ids))
        params.update(max_tokens=max(1, int(limit)), logprobs=True)  # the behaviour policy's log-probs
        record = _TRAJECTORY.get()
        if record is not None and record.sequence is not None and prompt_ids[:len(record.sequence)] != record.sequence:
            raise NonExtendingTurnError(
                f"agent loop turn {record.turns + 1}: its prompt does not extend the trajectory so far (the previous "
                "turn's prompt + the tokens generated, then what came between). verl 0.9.1's AgentLoopOutput holds "
                "one token sequence, so a loop that summarises or truncates its context between turns cannot be "
                "trained as one trajectory; make each turn extend the last")
        served = self.served_version()
        request_id, server_id = str(request_id), None
        if self.router is None:
            index = self._replica_for(request_id)
        else:
            index, server_id = await self.router.acquire(self, request_id, prompt_ids=prompt_ids,
                                                         sampling_params=sampling_params, image_data=image_data)
        try:
            out = await generate_resumable(self.servers, index, prompt_ids, params, self.request_timeout_s, served,
                                           image_data=image_data or None)
        finally:
            if server_id is not None:
                self._release_server(server_id, request_id=request_id)
        if record is not None:
            record.sequence = prompt_ids + list(out.token_ids)
            record.versions += out.token_versions
            record.turns += 1
            record.segments += out.segments
        low, high = (min(out.token_versions), max(out.token_versions)) if out.token_versions else (served, served)
        return TokenOutput(token_ids=out.token_ids, log_probs=out.log_probs, stop_reason=out.stop_reason,
                           num_preempted=0,
                           extra_fields={"global_steps": high, "min_global_steps": low, "max_global_steps": high})


class PipelineAgentLoopWorker(AgentLoopWorker):
    """verl's `AgentLoopWorker`, each trajectory recording its model tokens' versions (`VERSIONS_FIELD`)
    and the turns a load split (`TURNS_INTERRUPTED`) among its extra fields. `tool_pool_size`: each tool's
    environments in use at once (an EnvironmentPool per tool, waits bounded by `tool_timeout_s`, the
    seconds waited in `TOOL_POOL_WAIT`); None: no limit. `teacher_client`: verl's, distillation's teachers by
    routing key (async_rl/rollout/teachers.py); verl's worker scores each training trajectory with its teacher."""

    def __init__(self, config, client: PipelineLLMClient, tool_timeout_s: float = 120.0,
                 tool_pool_size: Optional[int] = None, teacher_client: Optional[dict] = None):
        # resolved once: loops read the config per trajectory, and each read of an interpolated key parses it
        super().__init__(OmegaConf.create(OmegaConf.to_container(config, resolve=True)), client,
                         teacher_client=teacher_client)
        self.pools = {tool.name: EnvironmentPool(tool.name, tool_pool_size, tool_timeout_s)
                      for tool in self.tools} if tool_pool_size is not None else {}
        for tool in self.tools:  # verl's loaders built them; every loop of this worker shares them
            bound_tool_calls(tool, tool_timeout_s, self.pools.get(tool.name))
        self._factories: dict[str, Callable] = {}  # agent name -> loop_factory of its registry entry

    async def _run_agent_loop(self, sampling_params, trajectory, *, agent_name, trace=True, **kwargs):
        """verl's `_run_agent_loop` (a fresh loop per trajectory, built with the arguments verl gives it, run,
        then verl's post-processing), the loop built by `loop_factory` instead of a per-trajectory
        `hydra.utils.instantiate` (which cost 4x the rest of a single-turn trajectory's work here)."""
        record = TrajectoryRecord()
        _TRAJECTORY.set(record)  # verl runs each trajectory in its own task: the record is this one's
        with rollout_trace_attr(step=trajectory["step"], sample_index=trajectory["sample_index"],
                                rollout_n=trajectory["rollout_n"], validate=trajectory["validate"], name="agent_loop",
                                trace=trace):
            if agent_name not in _agent_loop_registry:
                raise ValueError(f"agent loop {agent_name!r} is not registered; registered: "
                                 f"{', '.join(sorted(_agent_loop_registry))}")
            if agent_name not in self._factories:
                self._factories[agent_name] = loop_factory(_agent_loop_registry[agent_name])
            loop = self._factories[agent_name](
                trainer_config=DictConfigWrap(config=self.config), server_manager=self.llm_client,
                tokenizer=self.tokenizer, processor=self.processor, hf_model_type=self.hf_model_type,
                dataset_cls=self.dataset_cls, data_config=DictConfigWrap(self.config.data),
                tools=ToolListWrap(self.tools))
            output = await loop.run(sampling_params, **kwargs)
            output = await self._agent_loop_postprocess(output, trajectory["validate"], **kwargs)
        output.extra_fields[VERSIONS_FIELD] = record.versions
        output.extra_fields[TURNS_INTERRUPTED] = record.segments - record.turns
        output.extra_fields[TOOL_POOL_WAIT] = record.pool_wait_s
        return output


def loop_factory(entry) -> Callable:
    """`factory(**verl's arguments) -> agent loop` for a registry entry (`{_target_, ...}`), as
    `hydra.utils.instantiate(entry, **arguments)` builds it: the `_target_` called with the entry's other
    keys and the arguments. Resolved once; an entry with hydra's own keys (`_partial_`, `_recursive_`,
    ...) or non-scalar values stays with hydra."""
    fields = OmegaConf.to_container(entry, resolve=True) if OmegaConf.is_config(entry) else dict(entry)
    target = fields.pop("_target_")
    if any(key.startswith("_") or isinstance(value, (dict, list)) for key, value in fields.items()):
        return functools.partial(hydra.utils.instantiate, entry)
    return functools.partial(hydra.utils.get_object(target), **fields)


TOOL_TIMEOUT_KEY = "actor_rollout_ref.rollout.multi_turn.tool_timeout_s"


class ToolTimeoutError(TimeoutError):
    """A tool call of an agent loop did not answer within `tool_timeout_s`."""


def bound_tool_calls(tool, timeout_s: float, pool: Optional[EnvironmentPool] = None) -> None:
    """Bound every call into `tool` (a verl FunctionTool's `call`; a BaseTool's `create`, `execute`,
    `release`) by `timeout_s` (s), in place: a call past it raises ToolTimeoutError naming the tool and
    the key. verl's tool loop catches what `call`, `create` and `execute` raise and hands the model the
    error as the tool's reply; the trajectory goes on. With a `pool`, a `call` holds one of its
    environments while it runs, a BaseTool instance from `create` to `release` (verl's loop releases
    each instance after its call); the seconds waited for one add to the trajectory's record."""
    def bounded(method):
        async def call(*args, **kwargs):
            try:
                return await asyncio.wait_for(method(*args, **kwargs), timeout_s)
            except asyncio.TimeoutError:
                raise ToolTimeoutError(f"tool {tool.name!r} did not answer within {timeout_s:g} s "
                                       f"({TOOL_TIMEOUT_KEY})") from None
        return call

    async def take_environment() -> None:
        waited = await pool.acquire()
        record = _TRAJECTORY.get()
        if record is not None:
            record.pool_wait_s += waited

    def pooled_call(method):
        async def call(*args, **kwargs):
            await take_environment()
            try:
                return await method(*args, **kwargs)
            finally:
                pool.release()
        return call

    def pooled_create(method):
        async def create(*args, **kwargs):
            await take_environment()
            try:
                created = await method(*args, **kwargs)
            except BaseException:
                pool.release()
                raise
            if not (created[0] if isinstance(created, tuple) else created):
                pool.release()  # verl's loop releases only an instance with an id
            return created
        return create

    def pooled_release(method):
        async def release(*args, **kwargs):
            try:
                return await method(*args, **kwargs)
            finally:
                pool.release()
        return release

    if isinstance(tool, FunctionTool):
        tool.call = bounded(tool.call) if pool is None else pooled_call(bounded(tool.call))
        return
    tool.create, tool.execute, tool.release = bounded(tool.create), bounded(tool.execute), bounded(tool.release)
    if pool is not None:
        tool.create, tool.release = pooled_create(tool.create), pooled_release(tool.release)


DO_SAMPLE = "__do_sample__"  # verl's per-row column: False makes the agent loop sample greedily (ReMax)


def prompt_rows(batch_non_tensor: list[dict], uids: list[str], n: int, global_steps: int,
                greedy_baselines: bool = False):
    """verl's agent-loop input (a DataProto of non-tensor columns), each prompt's row `n` times in a
    row (GRPO groups), with its `uid`, and `global_steps` (the step verl's agent loops and rollout trace see);
    `greedy_baselines` (ReMax): then each prompt's row once more, sampled greedily (verl's `__do_sample__`
    column)."""
    from verl import DataProto

    for row in batch_non_tensor:
        decode_images(row.get("raw_prompt"))
    rows = [{**row, "uid": uid} for row, uid in zip(batch_non_tensor, uids) for _ in range(n)]
    if greedy_baselines:
        rows = [{**row, DO_SAMPLE: True} for row in rows]
        rows += [{**row, "uid": uid, DO_SAMPLE: False} for row, uid in zip(batch_non_tensor, uids)]
    keys = sorted({key for row in rows for key in row})
    columns = {key: object_column([row.get(key) for row in rows]) for key in keys}
    proto = DataProto.from_dict(non_tensors=columns)
    proto.meta_info["global_steps"] = global_steps
    return proto


def decode_images(messages) -> None:
    """Decode now every PIL image in `messages` (a row's `raw_prompt`): PIL decodes a file's pixels at first
    use, and the n trajectories of a row read its one image object from verl's threads at once."""
    for message in messages if messages is not None else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, (list, tuple, np.ndarray)) else ():
            image = part.get("image") if isinstance(part, dict) else None
            if hasattr(image, "load"):
                image.load()


def _python_scalar(value):
    """A numpy scalar as Python's (a column of numpy ints in an object array averages to an int)."""
    return value.item() if isinstance(value, np.generic) else value


def samples_from_agent_output(output, start_version: int) -> list[Sample]:
    """One Sample per row of verl's agent-loop output (unpadded: the prompt's tokens, the response's
    tokens with `response_mask` 1 on model tokens, 0 on tool/environment tokens). Each model token gets
    the version recorded for it (a loop marking more model tokens than were generated: the last recorded
    version on the rest; none recorded: `start_version`); tool tokens get -1, like padding. A multimodal
    model's rows keep verl's `multi_modal_inputs` and their multimodal RoPE rows (`position_ids` rows 1-3)
    over their tokens; a trajectory a distillation teacher scored keeps the teacher's ids and log-probs over
    its tokens (`teacher_ids`, `teacher_logprobs`)."""
    batch, columns = output.batch, output.non_tensor_batch
    rope = batch["position_ids"] if batch["position_ids"].dim() == 3 else None  # (bs, 1 + ROPE_ROWS, seq_len)
    timings = output.meta_info.get("metrics") or []
    prompt_width = batch["prompts"].shape[1]
    samples = []
    for i in range(len(output)):
        mask = batch["attention_mask"][i]
        prompt_ids = batch["prompts"][i][mask[:prompt_width].bool()].tolist()
        length = int(mask[prompt_width:].sum())
        response_ids = batch["responses"][i][:length].tolist()
        model_tokens = batch["response_mask"][i][:length].tolist()
        log_probs = (batch["rollout_log_probs"][i][:length].tolist() if "rollout_log_probs" in batch.keys()
                     else [0.0] * length)
        recorded = list(columns[VERSIONS_FIELD][i] or []) if VERSIONS_FIELD in columns else []
        versions, k = [], 0
        for is_model in model_tokens:
            if is_model:
                versions.append(int(recorded[min(k, len(recorded) - 1)]) if recorded else start_version)
                k += 1
            else:
                versions.append(-1)
        non_tensor = {key: _python_scalar(columns[key][i]) for key in columns
                      if key not in (VERSIONS_FIELD, "uid", DO_SAMPLE)}
        non_tensor["start_version"] = start_version
        for name, column in AGENT_LOOP_TIMINGS.items():  # verl's per-trajectory AgentLoopMetrics, seconds
            non_tensor[column] = float(timings[i].get(name, 0.0)) if i < len(timings) else 0.0
        rope_rows = rope[i, 1:, mask.bool()].tolist() if rope is not None else None
        teacher = ({key: batch[key][i][mask.bool()].clone() for key in TEACHER_KEYS}
                   if TEACHER_KEYS[0] in batch.keys() else dict.fromkeys(TEACHER_KEYS))
        samples.append(Sample(uid=str(columns["uid"][i]), prompt_ids=prompt_ids, response_ids=response_ids,
                              rollout_log_probs=log_probs, token_versions=versions, non_tensor=non_tensor,
                              response_mask=[int(m) for m in model_tokens], rope_position_ids=rope_rows,
                              **teacher))
    return samples
