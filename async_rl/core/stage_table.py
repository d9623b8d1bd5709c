"""The built-in stages, one `StageSpec` row each: a built-in stage is one row here plus its class.

The driver builds every row the run has, in this order (a row after those it `needs`), and
wires the graph the rows' `inputs` make (async_rl/core/stage_graph.py); placement puts each
stage on the node of its `role`'s workers; actor_train joins a step from the rows that
`join` it. A row names its class by import path, so that this layer imports no stage.

`kwargs(b)` gives the constructor's keyword arguments from `b`, the build's inputs
(`StageInputs` in async_rl/build.py): `b.config` (the verl config), `b.run` (the RunConfig),
`b.settings` (its pipeline keys), `b.clock` (the `ClockRef`, async_rl/core/policy_clock.py),
`b.stages` (name -> handle of the stages built so far), and the values the driver prepares
once: tokenizer, processor, servers, replicas, reward_router, devices, bucket_bytes,
receivers, checkpointer, transports, ref_enabled, step_parts and the resume point's
start_step, generated, dataloader_state, sampling_pool, kl_coef.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from async_rl.core.messages import LogpResult, RefLogpResult, ScoredBatch, TrainingBatch, ValuesResult

DATALOADER, GENERATE, ROLLOUT, REWARD, DYNAMIC_SAMPLING = "dataloader", "generate", "rollout", "reward", "dynamic_sampling"
LOGP, REF_LOGP, PARAM_UPDATE, CRITIC_TRAIN, VALUES = "logp", "ref_logp", "param_update", "critic_train", "values"
ACTOR_TRAIN = "actor_train"
CLOCK = "clock"  # the policy clock's name in the process it shares with generate (no stage may take it)


@dataclass(frozen=True)
class RunShape:
    """What decides which rows a run has: a critic (PPO with GAE), DAPO's dynamic sampling."""

    critic: bool = False
    dynamic_sampling: bool = False


@dataclass(frozen=True)
class Join:
    """A stage's output `message` is part `part` of actor_train's step."""

    part: str
    message: type


def _always(shape: RunShape) -> bool:
    return True


def _no_kwargs(b: Any) -> dict:
    return {}


@dataclass(frozen=True)
class StageSpec:
    """One built-in stage.

    name: the stage's name (metrics `async/<name>/*`, errors, `trainer.async_stages.*.after`).
    cls: its `StateMachine` subclass, "package.module.Class".
    inputs: the stages that feed it; an entry that is a tuple names alternatives, of which the first
        the run has feeds it (with dynamic sampling, training batches come from dynamic_sampling).
    side_input: a stage feeding it by direct calls, outside the graph's edges (its END_OF_STREAM counts).
    role: whose workers' node it runs on: a training role of the placement ("train", "critic", "logp",
        "ref_logp", where the run has it) or "generate" (the first rollout replica's); None: the driver's.
    joins: how its output joins actor_train's step (None: it does not).
    when: whether a run of this shape has it.
    needs: the stages whose handles its kwargs take (built before it, where the run has them).
    starts_workers: its `setup()` starts a verl worker group (called once every stage is built).
    loads_checkpoint: a resume loads its share of the checkpoint (`load_checkpoint(path, delete)`).
    kwargs: its constructor's keyword arguments, `kwargs(b)` (b: the build's inputs, see the module).
    """

    name: str
    cls: str
    inputs: tuple[Union[str, tuple[str, ...]], ...] = ()
    side_input: Optional[str] = None
    role: Optional[str] = None
    joins: Optional[Join] = None
    when: Callable[[RunShape], bool] = _always
    needs: tuple[str, ...] = ()
    starts_workers: bool = False
    loads_checkpoint: bool = False
    kwargs: Callable[[Any], dict] = _no_kwargs


def _restarts(b) -> int:
    return b.settings.replica_max_restarts


STAGES: tuple[StageSpec, ...] = (
    StageSpec(DATALOADER, "state_machines.dataloader.DataloaderStage", kwargs=lambda b: dict(
        config=b.config, tokenizer=b.tokenizer, processor=b.processor, first_index=b.generated,
        total_batches=None if b.settings.dynamic_sampling else b.run.total_steps, resume_state=b.dataloader_state)),
    StageSpec(GENERATE, "state_machines.generate.GenerateStage", inputs=(DATALOADER,), role="generate",
              needs=(PARAM_UPDATE,), kwargs=lambda b: dict(
        servers=b.servers, config=b.config, clock=b.clock, request_timeout_s=b.settings.request_timeout_s,
        tool_timeout_s=b.settings.tool_timeout_s, tool_pool_size=b.settings.tool_pool_size,
        replicas=b.replicas if _restarts(b) else None, max_restarts=_restarts(b), relaunch=b.run.backend.relaunch,
        weight_source=b.stages[PARAM_UPDATE], teacher_routers=b.teacher_routers)),
    StageSpec(ROLLOUT, "state_machines.rollout.RolloutStage", inputs=(GENERATE,), kwargs=lambda b: dict(
        max_prompt_length=int(b.config.data.max_prompt_length),
        max_response_length=int(b.config.actor_rollout_ref.rollout.response_length), pad_token_id=b.pad_token_id)),
    StageSpec(REWARD, "state_machines.reward.RewardStage", inputs=(ROLLOUT,), joins=Join("reward", ScoredBatch),
              kwargs=lambda b: dict(config=b.config, tokenizer=b.tokenizer, timeout_s=b.settings.reward_timeout_s,
                                    on_error=b.settings.reward_on_error, reward_router=b.reward_router)),
    StageSpec(DYNAMIC_SAMPLING, "state_machines.dynamic_sampling.DynamicSamplingStage", inputs=(REWARD,),
              joins=Join("reward", TrainingBatch), when=lambda shape: shape.dynamic_sampling, needs=(DATALOADER,),
              kwargs=lambda b: dict(config=b.config, clock=b.clock, total_steps=b.run.total_steps,
                                    dataloader=b.stages[DATALOADER], start_step=b.start_step,
                                    generated_batches=b.generated, pool=b.sampling_pool)),
    StageSpec(LOGP, "state_machines.logp.LogpStage", inputs=((DYNAMIC_SAMPLING, ROLLOUT),), role="logp",
              joins=Join("logp", LogpResult), starts_workers=True, kwargs=lambda b: dict(
        config=b.config, devices=b.devices.get("logp", 0), consume_bucket_bytes=b.bucket_bytes["consume"],
        compute=b.run.proximal_logp_workers == "logp")),
    StageSpec(REF_LOGP, "state_machines.ref_logp.RefLogpStage", inputs=((DYNAMIC_SAMPLING, ROLLOUT),),
              role="ref_logp", joins=Join("ref_logp", RefLogpResult), starts_workers=True, kwargs=lambda b: dict(
        config=b.config, devices=b.devices.get("ref_logp", 0), enabled=b.ref_enabled)),
    StageSpec(PARAM_UPDATE, "state_machines.param_update.ParamUpdateStage", inputs=(ACTOR_TRAIN,), role="train",
              needs=(LOGP,), kwargs=lambda b: dict(
        receivers=b.receivers, clock=b.clock.handle, restartable_servers=bool(_restarts(b)),
        server_timeout_s=min(300.0, b.settings.request_timeout_s), transports=b.transports)),
    StageSpec(CRITIC_TRAIN, "state_machines.critic_train.CriticTrainStage", side_input=ACTOR_TRAIN, role="critic",
              when=lambda shape: shape.critic, starts_workers=True, loads_checkpoint=True, kwargs=lambda b: dict(
        config=b.config, devices=b.devices["critic"], start_step=b.start_step)),
    StageSpec(VALUES, "state_machines.values.ValuesStage", inputs=((DYNAMIC_SAMPLING, ROLLOUT),), role="critic",
              joins=Join("values", ValuesResult), when=lambda shape: shape.critic, needs=(CRITIC_TRAIN,),
              kwargs=lambda b: dict(critic_train=b.stages[CRITIC_TRAIN])),
    StageSpec(ACTOR_TRAIN, "state_machines.actor_train.ActorTrainStage",
              inputs=((DYNAMIC_SAMPLING, REWARD), LOGP, REF_LOGP, VALUES), role="train", starts_workers=True,
              loads_checkpoint=True, needs=(PARAM_UPDATE, CRITIC_TRAIN, DATALOADER, DYNAMIC_SAMPLING),
              kwargs=lambda b: dict(
        config=b.config, devices=b.devices["train"], clock=b.clock, weight_sink=b.stages[PARAM_UPDATE],
        bucket_bytes=b.bucket_bytes["preduce"], compute_proximal=b.run.proximal_logp_workers == "train",
        start_step=b.start_step, checkpointer=b.checkpointer, kl_coef=b.kl_coef,
        critic_sink=b.stages.get(CRITIC_TRAIN), parts=b.step_parts)),
)

BY_NAME: dict[str, StageSpec] = {spec.name: spec for spec in STAGES}
# message type -> the part of actor_train's step it is (a stage inserted after a joining stage passes its type on)
JOIN_PARTS: dict[type, str] = {spec.joins.message: spec.joins.part for spec in STAGES if spec.joins is not None}


def stages_of(shape: RunShape) -> tuple[StageSpec, ...]:
    """The rows a run of `shape` has, in table order."""
    return tuple(spec for spec in STAGES if spec.when(shape))


def step_parts(names) -> tuple[str, ...]:
    """The parts actor_train joins for a step when the run has the stages `names`."""
    return tuple(dict.fromkeys(BY_NAME[n].joins.part for n in names if n in BY_NAME and BY_NAME[n].joins is not None))


def build_order(specs: tuple[StageSpec, ...]) -> list[StageSpec]:
    """`specs` in table order, each after the stages of `specs` it `needs`."""
    present = {spec.name for spec in specs}
    order: list[StageSpec] = []
    done: set[str] = set()
    pending = list(specs)
    while pending:
        ready = next((s for s in pending if all(n in done or n not in present for n in s.needs)), None)
        if ready is None:
            raise ValueError(f"stages that need each other: {[s.name for s in pending]}")
        pending.remove(ready)
        order.append(ready)
        done.add(ready.name)
    return order
