"""Building a run (async_rl/pipeline.py calls these in order): place it on the job's nodes, start
the rollout replicas, the policy clock and every stage of the stage table (async_rl/core/stage_table.py)
with its verl worker group, connect the weight sync, load the resume point; and take it all down
again. Each step fills the `BuiltPipeline`, so a failure midway still tears down what was started.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Optional

import ray
from omegaconf import open_dict
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.trainer.ppo.utils import need_reference_policy

import param_update.transports  # noqa: F401 - registers the built-in transports
from async_rl.api.rollout import RolloutBackend
from async_rl.api.weights import ReceiverSetup, TransportTable, transports_by_rank
from async_rl.checkpoint_dir import CheckpointDir
from async_rl.checkpoints import ResumePoint, RunCheckpointer, dataloader_workers_in_state, find_resume_point
from async_rl.core.config import AsyncPipelineConfig
from async_rl.core.devices import GroupDevices, reserve_nodes
from async_rl.core.errors import PipelineError
from async_rl.core.messages import NewWeights
from async_rl.core.policy_clock import ClockRef, PolicyClock
from async_rl.core.prompts import model_tokenizer_and_processor
from async_rl.core.stage_graph import upstream_counts
from async_rl.core.stage_table import (ACTOR_TRAIN, CLOCK, CRITIC_TRAIN, DATALOADER, DYNAMIC_SAMPLING, GENERATE, LOGP,
                                       PARAM_UPDATE, STAGES, RunShape, build_order, stages_of, step_parts)
from async_rl.core.staleness import StalenessGate
from async_rl.core.timeouts import CALL_TIMEOUT_S, SETUP_TIMEOUT_S
from async_rl.rollout.reward_models import RewardModelService, start_reward_model
from async_rl.rollout.teachers import TeacherService, start_teachers
from async_rl.rollout.supervisor import kill_actor
from async_rl.rollout.verl_replicas import announce_to_prometheus, launch_rollout_replicas, make_rollout_replicas
from async_rl.run_config import RunConfig
from async_rl.stop_signals import PipelinePreempted, StopRequest
from async_rl.validation import Validator
from param_update.capacity import check_weight_sync, model_weight_bytes, planned_links
from param_update.receivers import ActorReceiver
from state_machines.host import HostedStage, StageHost

logger = logging.getLogger(__name__)

STAGE_CONCURRENCY = 64  # calls a stage's actor runs at once (its loop, puts from upstream, the driver's)


@dataclass
class BuiltPipeline:
    """A run's Ray actors and what the driver keeps of them; filled by the build steps in order."""

    run: RunConfig
    env_vars: dict = field(default_factory=dict)  # every Ray process of the run gets them (ray_init_kwargs)
    stop: Optional[StopRequest] = None  # set while stop signals are caught
    driver_node: str = ""  # the Ray node id of the driver (node 0 of the placement)
    node_groups: tuple = ()  # one Ray placement group per job node
    devices: dict = field(default_factory=dict)  # role -> GroupDevices; "generate" -> one per replica
    stage_nodes: dict = field(default_factory=dict)  # stage -> the Ray node id its actor is placed on
    replicas: list = field(default_factory=list)  # verl RolloutReplica objects, started
    reward_model: Optional[RewardModelService] = None  # the reward model's servers and router, if enabled
    teachers: Optional[TeacherService] = None  # distillation's teacher servers and load balancers, if enabled
    stages: dict[str, Any] = field(default_factory=dict)  # stage name -> Ray actor handle or HostedStage
    clock: Optional[ClockRef] = None  # the policy clock: the staleness gate and its handle
    clock_actor: Any = None  # the clock's own Ray actor (`per_stage`; `per_node`: it is in generate's host)
    hosts: dict[str, Any] = field(default_factory=dict)  # node id -> the StageHost of that node's stages
    adding: dict[str, Any] = field(default_factory=dict)  # hosted stage -> its `add` call, until built
    receivers: list = field(default_factory=list)  # WeightReceivers of the weight sync
    validator: Optional[Validator] = None
    resume_point: Optional[ResumePoint] = None
    start_step: int = 0  # the trainer's version at start (the resumed step)
    bucket_bytes: dict = field(default_factory=dict)  # "preduce" / "consume" -> bytes
    world_sizes: dict = field(default_factory=dict)  # role -> ranks
    adapter: Any = None  # the trainer's LoRA adapter (param_update/lora.py LoraAdapter), None without LoRA
    training: bool = False  # the stages' loops run

    def wait(self, refs: dict[str, Any], timeout_s: float, what: str) -> dict[str, Any]:
        """Results of `refs` (name -> ObjectRef); PipelineError naming the late or failed ones,
        PipelinePreempted on a stop signal before training starts."""
        names = list(refs)
        deadline = time.monotonic() + timeout_s
        pending = list(refs.values())
        while pending:
            self.raise_if_stopping(f"while waiting to {what}")
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(1.0, max(deadline - time.monotonic(), 0)))
            if pending and time.monotonic() >= deadline:
                late = [n for n, r in refs.items() if r in pending]
                raise PipelineError(f"timed out after {timeout_s:g} s waiting to {what}: {late}")
        try:
            return dict(zip(names, ray.get(list(refs.values()), timeout=timeout_s)))
        except ray.exceptions.RayError as exc:
            raise PipelineError(f"failed to {what}: {exc}") from exc

    def raise_if_stopping(self, where: str) -> None:
        """Before training starts a stop signal has nothing to save: stop at once (after, the loop
        stops at a step boundary with a checkpoint)."""
        if self.stop is not None and self.stop.requested and not self.training:
            raise PipelinePreempted(self.stop.signum, None, where)

    def stage(self, stage_name: str, cls, **kwargs):
        """Start stage `stage_name` as `cls(**kwargs)` on its node: in the node's StageHost
        (`trainer.stage_processes=per_node`) or as a Ray actor of its own (`per_stage`). Logical CPUs:
        stages mostly wait."""
        node = self.node_of(stage_name)
        if self.run.async_cfg.stage_processes == "per_stage":
            self.stages[stage_name] = self._actor(cls, stage_name, node, STAGE_CONCURRENCY).remote(**kwargs)
        else:
            self.adding[stage_name] = self.host_of(node).add.remote(stage_name, cls, (), kwargs)
            self.stages[stage_name] = HostedStage(self.hosts[node], stage_name)
        return self.stages[stage_name]

    def start_clock(self, gate: StalenessGate) -> ClockRef:
        """The policy clock, in the generate stage's process (async_rl/core/policy_clock.py): in its node's
        StageHost, or (`per_stage`) an actor of its own on that node."""
        node, kwargs = self.node_of(GENERATE), {"start_step": self.start_step}
        if self.run.async_cfg.stage_processes == "per_stage":
            handle = self.clock_actor = self._actor(PolicyClock, CLOCK, node, STAGE_CONCURRENCY).remote(**kwargs)
        else:
            self.adding[CLOCK] = self.host_of(node).add.remote(CLOCK, PolicyClock, (), kwargs)
            handle = HostedStage(self.hosts[node], CLOCK)
        self.clock = ClockRef(gate, handle)
        return self.clock

    def host_of(self, node: str):
        """The StageHost of the stages placed on `node` (started at the first call)."""
        if node not in self.hosts:
            on_node = [s for s in self.run.edges if self.node_of(s) == node]
            self.hosts[node] = self._actor(StageHost, "+".join(on_node), node,
                                           STAGE_CONCURRENCY * len(on_node)).remote(len(on_node))
        return self.hosts[node]

    def node_of(self, stage_name: str) -> str:
        """The Ray node id stage `stage_name` runs on (the driver's unless placed beside its workers)."""
        return self.stage_nodes.get(stage_name, self.driver_node)

    def _actor(self, cls, label: str, node: str, concurrency: int):
        return ray.remote(cls).options(
            name=f"async_rl_{label}_{os.getpid()}", num_cpus=0, max_concurrency=concurrency,
            runtime_env={"env_vars": self.env_vars}, scheduling_strategy=NodeAffinitySchedulingStrategy(node, False))

    def wait_for_stages(self) -> None:
        """Every hosted stage built (a host runs its calls in no set order); PipelineError naming a stage
        whose constructor raised."""
        adding, self.adding = self.adding, {}
        self.wait(adding, SETUP_TIMEOUT_S, "start the stages")

    def describe_processes(self) -> str:
        """One log line: how many processes run the stages, and which stages each holds (in graph order)."""
        mode = self.run.async_cfg.stage_processes
        names = [s for s in self.run.edges if s in self.stages]
        if mode == "per_stage":
            return f"{len(names)} ({mode}): {', '.join(names)}"
        groups = {node: [s for s in names if isinstance(self.stages[s], HostedStage) and self.stages[s].host is host]
                  for node, host in self.hosts.items()}
        return f"{len(groups)} ({mode}): " + "; ".join(f"{'+'.join(s)} on node {n[:8]}" for n, s in groups.items())

    def actors(self) -> list:
        """Every Ray actor running the run's stages and its clock (a host once)."""
        own = [h for h in self.stages.values() if not isinstance(h, HostedStage)]
        return [*self.hosts.values(), *own, *([self.clock_actor] if self.clock_actor is not None else [])]


def place(built: BuiltPipeline) -> None:
    """Reserve the job's nodes for the run's placement and pick each stage actor's node (the stage
    table's `role`: the node of that role's workers, or of the first rollout replica)."""
    plan = built.run.placement
    per_node = plan.devices_per_node
    built.driver_node = ray.get_runtime_context().get_node_id()
    built.node_groups, node_ids = reserve_nodes(plan, built.run.on_cpu, SETUP_TIMEOUT_S)
    logger.warning("placement: %s", plan.describe())
    built.devices = {role: GroupDevices(built.node_groups, r, per_node, plan.colocate_count)
                     for role, r in plan.groups.items()}
    built.devices["generate"] = [GroupDevices(built.node_groups, r, per_node) for r in plan.replicas]
    built.world_sizes = {role: d.world_size for role, d in built.devices.items() if role != "generate"}
    node_of = {role: node_ids[r.start // per_node] for role, r in plan.groups.items()}
    node_of["generate"] = node_ids[plan.replicas[0].start // per_node]
    built.stage_nodes = {spec.name: node_of[spec.role] for spec in STAGES if spec.role in node_of}


class StageInputs:
    """What the stage table's `kwargs(b)` read (async_rl/core/stage_table.py): the run, the values
    `build_stages` prepares once, and the handles of the stages built so far (`stages`)."""

    def __init__(self, built: BuiltPipeline, tokenizer, processor, state):
        self.built, self.tokenizer, self.processor, self.state = built, tokenizer, processor, state
        self.run, self.config, self.settings = built.run, built.run.config, built.run.async_cfg
        self.stages, self.clock, self.devices = built.stages, built.clock, built.devices
        self.replicas, self.servers = built.replicas, [r.server_handle for r in built.replicas]
        self.bucket_bytes, self.start_step = built.bucket_bytes, built.start_step
        self.reward_router = built.reward_model.router_address if built.reward_model is not None else None
        self.teacher_routers = built.teachers.routers if built.teachers is not None else {}
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.generated = state.generated_batches if state is not None else 0
        self.dataloader_state = state.dataloader_state if state is not None else None
        self.sampling_pool = state.sampling_pool if state is not None else None
        self.kl_coef = state.kl_coef if state is not None else None
        self.ref_enabled = need_reference_policy(self.config)
        self.transports = TransportTable(transports_by_rank(), delta=self.settings.delta_sync)
        self.step_parts = step_parts(self.run.edges)

    @cached_property
    def receivers(self) -> list:
        """The weight sync's receivers: every rollout replica, and the logp stage where it computes pi_prox
        (kept as `built.receivers`)."""
        restarts = self.settings.replica_max_restarts
        receivers = [self.run.backend.make_receiver(i, r, self.settings.partial_rollout, i if restarts else None)
                     for i, r in enumerate(self.replicas)]
        if self.run.proximal_logp_workers == "logp":
            receivers.append(ActorReceiver(LOGP, self.stages[LOGP], serves_generation=False))
        self.built.receivers = receivers
        return receivers

    @cached_property
    def checkpointer(self) -> Optional[RunCheckpointer]:
        """The run's checkpoints (None: `trainer.save_freq` <= 0); what a killed save left recovered."""
        if self.run.checkpoint.save_freq <= 0:
            return None
        CheckpointDir(self.run.checkpoint.root).recover()
        return RunCheckpointer(self.run.checkpoint, self.run.total_steps, self.stages[DATALOADER],
                               self.stages.get(DYNAMIC_SAMPLING), self.stages.get(CRITIC_TRAIN), config=self.config)


def stage_class(path: str) -> type:
    """A stage table row's class from its "package.module.Class"."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def build_stages(built: BuiltPipeline) -> None:
    """Start the rollout replicas, the policy clock and every stage with its worker group, and wire the
    stage graph."""
    run, cfg, settings = built.run, built.run.config, built.run.async_cfg
    tokenizer, processor = model_tokenizer_and_processor(cfg)
    built.replicas = launch_rollout_replicas(make_rollout_replicas(cfg, len(built.devices["generate"])), run.backend,
                                             built.devices["generate"], SETUP_TIMEOUT_S)
    announce_to_prometheus(cfg, built.replicas)
    built.reward_model = start_reward_model(cfg, SETUP_TIMEOUT_S, settings.replica_max_restarts)
    built.teachers = start_teachers(cfg, SETUP_TIMEOUT_S)
    router = built.reward_model.router_address if built.reward_model is not None else None
    built.validator = Validator(cfg, tokenizer, settings.reward_timeout_s, settings.reward_on_error,
                                reward_router=router, processor=processor)
    workers = int(cfg.data.get("dataloader_num_workers", 0) or 0) if run.dataloader_workers_named else None
    built.resume_point = find_resume_point(run.checkpoint, built.world_sizes["train"], workers,
                                           settings.dynamic_sampling, built.world_sizes["critic"] if run.critic else None)
    state = built.resume_point.state if built.resume_point is not None else None
    saved_workers = dataloader_workers_in_state(state.dataloader_state) if state is not None else None
    if workers is None and saved_workers is not None:  # the pipeline sized them: the checkpoint's count,
        with open_dict(cfg.data):  # which its dataloader state needs
            cfg.data.dataloader_num_workers = saved_workers
    built.start_step = state.global_step if state is not None else 0
    built.bucket_bytes = check_weight_sync_room(built)
    built.start_clock(StalenessGate(settings.max_staleness, steps_formed_after_generation=settings.dynamic_sampling))

    inputs = StageInputs(built, tokenizer, processor, state)
    specs = stages_of(RunShape(critic=run.critic, dynamic_sampling=settings.dynamic_sampling))
    for spec in build_order(specs):
        built.stage(spec.name, stage_class(spec.cls), **spec.kwargs(inputs))
    for spec in settings.user_stages:
        built.stage(spec.name, run.user_stages[spec.name], config=cfg, name=spec.name, **spec.kwargs)

    built.wait_for_stages()
    logger.warning("stage processes: %s", built.describe_processes())
    # engines start in parallel; each has its own timeout-bounded wait
    built.wait({s.name: built.stages[s.name].setup.remote() for s in specs if s.starts_workers}, SETUP_TIMEOUT_S,
               "start verl worker groups")
    # verl's agent loops with val_kwargs sampling; restarts and timeouts apply to validation too
    generate = built.stages[GENERATE]
    built.validator.generate = lambda rows, n, step: generate.run_agent_loops.remote(rows, n, None, True, step=step)
    upstreams = upstream_counts(run.edges)
    built.wait({name: built.stages[name].connect.remote([built.stages[d] for d in downstream], upstreams[name])
                for name, downstream in run.edges.items()}, CALL_TIMEOUT_S, "wire stages")


def check_weight_sync_room(built: BuiltPipeline) -> dict[str, int]:
    """Bucket sizes (bytes) after the start-time checks of param_update/capacity.py, for the links the
    placement will use (the driver runs on node 0 of the placement: train rank 0's)."""
    run, settings = built.run, built.run.async_cfg
    links = planned_links(run.placement, run.backend.receivers_tell_nodes, run.proximal_logp_workers == "logp")
    rooms = {cls.name: cls.room_bytes() for cls in transports_by_rank()}
    return check_weight_sync(model_weight_bytes(run.config.actor_rollout_ref.model.path),
                             settings.preduce_bucket_size_mb, settings.consume_bucket_size_mb,
                             versions_held(settings, run.backend), links, rooms)


def versions_held(settings: AsyncPipelineConfig, backend: RolloutBackend) -> int:
    """Versions the transports' memory holds for a receiver at once: 2 with the dual buffer (serving and
    arriving), with restarts (the newest kept) or with deltas into verl's replicas (the base stays staged as views
    of what arrived), else 1."""
    keeps_base = settings.delta_sync and backend.gpu_server
    return 2 if settings.enable_dual_buffer or settings.replica_max_restarts or keeps_base else 1


def start_weight_sync(built: BuiltPipeline) -> None:
    """Set every rollout receiver up for the trainer's layout (a mismatch fails here, at start)."""
    trainer = built.stages[ACTOR_TRAIN]
    layout, built.adapter = built.wait({ACTOR_TRAIN: trainer.weight_layout.remote()}, CALL_TIMEOUT_S,
                                       "read the trainer's weight layout")[ACTOR_TRAIN]
    settings = built.run.async_cfg
    setup = built.stages[PARAM_UPDATE].configure_rollout_servers.remote(ReceiverSetup(
        settings.enable_dual_buffer, built.bucket_bytes["consume"], layout, settings.partial_rollout, built.adapter,
        settings.delta_sync))
    built.wait({PARAM_UPDATE: setup}, SETUP_TIMEOUT_S, "set up the rollout servers' weight staging")


def resume(built: BuiltPipeline) -> None:
    """Load the resume point into the train ranks (and the critic) and serve its weights before anything
    generates; without one, serve version 0 where the servers do not hold it yet: they start on dummy
    weights, or the trainer's LoRA adapter (`lora_adapter_path`: not zero) is not on their base."""
    point = built.resume_point
    if point is None:
        if built.run.backend.starts_on_dummy_weights or built.adapter is not None:
            serve_weights(built, 0)
        return
    logger.warning("resuming from %s (step %d, written by %s)", point.path, point.state.global_step, point.written_by)
    delete = built.run.checkpoint.del_local_after_load
    loads = {s.name: built.stages[s.name].load_checkpoint.remote(point.path, delete)
             for s in STAGES if s.loads_checkpoint and s.name in built.stages}
    built.wait(loads, SETUP_TIMEOUT_S, f"load the checkpoint {point.path}")
    serve_weights(built, point.state.global_step)


def serve_weights(built: BuiltPipeline, step: int) -> None:
    """Sync the train ranks' weights (version `step`) to every receiver before anything generates."""
    built.wait({PARAM_UPDATE: built.stages[PARAM_UPDATE].process_data.remote(NewWeights(step, time.time())),
                ACTOR_TRAIN: built.stages[ACTOR_TRAIN].send_weights.remote()},
               SETUP_TIMEOUT_S, f"send the weights of step {step} to the rollout servers")


CLOSE_TIMEOUT_S = 10.0  # at shutdown, unlinking the weight sync's shared-memory files may take this long


def shutdown(built: BuiltPipeline) -> None:
    """Free the weight sync's shared memory, kill every stage and replica server (their worker groups go
    with them) and free the job's nodes. Best effort: what is already gone is what we wanted."""
    if ACTOR_TRAIN in built.stages:
        try:
            ray.get(built.stages[ACTOR_TRAIN].close_weight_sender.remote(), timeout=CLOSE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a dead sender's files go at the next run's start
            logger.warning("the weight sync's shared-memory files were not unlinked; the next run removes them")
    for actor in [*built.actors(), *(s for r in built.replicas for s in r.servers)]:
        kill_actor(actor)
    if built.reward_model is not None:
        built.reward_model.stop()
    if built.teachers is not None:
        built.teachers.stop()
    if built.node_groups and ray.is_initialized():
        for group in built.node_groups:
            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001
                pass


def weight_digests(built: BuiltPipeline) -> dict[str, dict[str, str]]:
    """Per-tensor digests of the weights held by the trainer, the logp workers (when they compute) and
    every rollout replica the backend can read (receiver name -> digest): equal digests mean
    bit-identical weights."""
    calls = {ACTOR_TRAIN: built.stages[ACTOR_TRAIN].weight_digests.remote()}
    if built.run.proximal_logp_workers == "logp":
        calls[LOGP] = built.stages[LOGP].weight_digests.remote()
    digests = built.wait(calls, CALL_TIMEOUT_S, "read weight digests")
    read = built.run.backend.read_digests
    if read is not None:
        # each replica's current server, a restarted one included
        handles = ray.get(built.stages[GENERATE].server_handles.remote(), timeout=CALL_TIMEOUT_S)
        names = [r.name for r in built.receivers if r.serves_generation]

        async def read_all():  # gather needs the running loop
            return await asyncio.wait_for(asyncio.gather(*(read(h) for h in handles)), CALL_TIMEOUT_S)

        digests.update(zip(names, asyncio.run(read_all())))
    return digests
