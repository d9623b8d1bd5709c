"""Building a run (async_rl/pipeline.py calls these in order): place it on the job's nodes, start
the rollout replicas and every stage as a Ray actor with its verl worker group, connect the weight
sync, load the resume point; and take it all down again. Each step fills the `BuiltPipeline`, so a
failure midway still tears down what was started.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import ray
from omegaconf import open_dict
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.trainer.ppo.utils import need_reference_policy

import param_update.transports  # noqa: F401 - registers the built-in transports
from async_rl.api.weights import transports_by_rank
from async_rl.checkpoints import (CheckpointDir, ResumePoint, RunCheckpointer, dataloader_workers_in_state,
                                  find_resume_point)
from async_rl.core.devices import GroupDevices, reserve_nodes
from async_rl.core.errors import PipelineError
from async_rl.core.messages import NewWeights
from async_rl.core.prompts import model_tokenizer_and_processor
from async_rl.core.stage_graph import upstream_counts
from async_rl.core.timeouts import CALL_TIMEOUT_S, SETUP_TIMEOUT_S
from async_rl.rollout.reward_models import RewardModelService, start_reward_model
from async_rl.rollout.supervisor import kill_actor
from async_rl.rollout.verl_replicas import launch_rollout_replicas, make_rollout_replicas
from async_rl.run_config import RunConfig
from async_rl.stop_signals import PipelinePreempted, StopRequest
from async_rl.validation import Validator
from param_update.capacity import check_weight_sync, model_weight_bytes, planned_links
from param_update.receivers import ActorReceiver
from state_machines.actor_train import ActorTrainStage
from state_machines.critic_train import CriticTrainStage
from state_machines.dataloader import DataloaderStage
from state_machines.dynamic_sampling import DynamicSamplingStage
from state_machines.generate import GenerateStage
from state_machines.host import HostedStage, StageHost
from state_machines.logp import LogpStage
from state_machines.param_update import ParamUpdateStage
from state_machines.ref_logp import RefLogpStage
from state_machines.reward import RewardStage
from state_machines.rollout import RolloutStage
from state_machines.values import ValuesStage

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
    stages: dict[str, Any] = field(default_factory=dict)  # stage name -> Ray actor handle or HostedStage
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

    def stage(self, stage_name: str, cls, *args, **kwargs):
        """Start stage `stage_name` on its node: in the node's StageHost (`trainer.stage_processes=per_node`)
        or as a Ray actor of its own (`per_stage`). Logical CPUs: stages mostly wait."""
        node = self.node_of(stage_name)
        if self.run.async_cfg.stage_processes == "per_stage":
            self.stages[stage_name] = self._actor(cls, stage_name, node, STAGE_CONCURRENCY).remote(*args, **kwargs)
        else:
            if node not in self.hosts:
                on_node = [s for s in self.run.edges if self.node_of(s) == node]
                self.hosts[node] = self._actor(StageHost, "+".join(on_node), node,
                                               STAGE_CONCURRENCY * len(on_node)).remote(len(on_node))
            self.adding[stage_name] = self.hosts[node].add.remote(stage_name, cls, args, kwargs)
            self.stages[stage_name] = HostedStage(self.hosts[node], stage_name)
        return self.stages[stage_name]

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
        """One log line: how many processes run the stages, and which stages each holds."""
        mode = self.run.async_cfg.stage_processes
        if mode == "per_stage":
            return f"{len(self.stages)} ({mode}): {', '.join(self.stages)}"
        groups = {node: [s for s, h in self.stages.items() if isinstance(h, HostedStage) and h.host is host]
                  for node, host in self.hosts.items()}
        return f"{len(groups)} ({mode}): " + "; ".join(f"{'+'.join(s)} on node {n[:8]}" for n, s in groups.items())

    def actors(self) -> list:
        """Every Ray actor running the run's stages (a host once)."""
        return [*self.hosts.values(), *(h for h in self.stages.values() if not isinstance(h, HostedStage))]


def place(built: BuiltPipeline) -> None:
    """Reserve the job's nodes for the run's placement and pick each stage actor's node."""
    plan = built.run.placement
    per_node = plan.devices_per_node
    built.driver_node = ray.get_runtime_context().get_node_id()
    built.node_groups, node_ids = reserve_nodes(plan, str(built.run.config.trainer.device) == "cpu", SETUP_TIMEOUT_S)
    logger.warning("placement: %s", plan.describe())
    built.devices = {role: GroupDevices(built.node_groups, r, per_node, plan.colocate_count)
                     for role, r in plan.groups.items()}
    built.devices["generate"] = [GroupDevices(built.node_groups, r, per_node) for r in plan.replicas]
    built.world_sizes = {role: d.world_size for role, d in built.devices.items() if role != "generate"}
    node_of = {role: node_ids[r.start // per_node] for role, r in plan.groups.items()}
    built.stage_nodes = {"actor_train": node_of["train"], "param_update": node_of["train"],
                         "generate": node_ids[plan.replicas[0].start // per_node]}
    built.stage_nodes.update({stage: node_of[role] for stage, role in
                              (("logp", "logp"), ("ref_logp", "ref_logp"), ("critic_train", "critic"),
                               ("values", "critic")) if role in node_of})


def build_stages(built: BuiltPipeline) -> None:
    """Start the rollout replicas and every stage with its worker group, and wire the stage graph."""
    run, cfg, settings = built.run, built.run.config, built.run.async_cfg
    devices = built.devices
    tokenizer, processor = model_tokenizer_and_processor(cfg)
    built.replicas = launch_rollout_replicas(make_rollout_replicas(cfg, len(devices["generate"])), run.backend,
                                             devices["generate"], SETUP_TIMEOUT_S)
    servers = [r.server_handle for r in built.replicas]
    built.reward_model = start_reward_model(cfg, SETUP_TIMEOUT_S, settings.replica_max_restarts)
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
    generated = state.generated_batches if state else 0
    eta, steps, restarts = settings.max_staleness, run.total_steps, settings.replica_max_restarts
    proximal = run.proximal_logp_workers

    dataloader = built.stage("dataloader", DataloaderStage, cfg, tokenizer, None if settings.dynamic_sampling else steps,
                             generated, state.dataloader_state if state else None, processor=processor)
    generate = built.stage("generate", GenerateStage, servers, cfg, eta,
                           request_timeout_s=settings.request_timeout_s, tool_timeout_s=settings.tool_timeout_s,
                           tool_pool_size=settings.tool_pool_size,
                           dynamic_sampling=settings.dynamic_sampling,
                           steps_formed=built.start_step, replicas=built.replicas if restarts else None,
                           max_restarts=restarts, relaunch=run.backend.relaunch)
    built.stage("rollout", RolloutStage, int(cfg.data.max_prompt_length),
                int(cfg.actor_rollout_ref.rollout.response_length),
                tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    built.stage("reward", RewardStage, cfg, tokenizer, settings.reward_timeout_s, settings.reward_on_error, router)
    sampling = None
    if settings.dynamic_sampling:  # draws prompts until the training batches are full
        sampling = built.stage("dynamic_sampling", DynamicSamplingStage, cfg, eta, steps, generate, dataloader,
                               built.start_step, generated, state.sampling_pool if state else None)
    built.bucket_bytes = check_weight_sync_room(built)
    logp = built.stage("logp", LogpStage, cfg, devices.get("logp", 0), built.bucket_bytes["consume"],
                       compute=proximal == "logp")
    built.stage("ref_logp", RefLogpStage, cfg, devices.get("ref_logp", 0), need_reference_policy(cfg))
    built.receivers = [run.backend.make_receiver(i, r, settings.partial_rollout, i if restarts else None)
                       for i, r in enumerate(built.replicas)]
    if proximal == "logp":
        built.receivers.append(ActorReceiver("logp", logp, serves_generation=False))
    param_update = built.stage("param_update", ParamUpdateStage, built.receivers, generate,
                               restartable_servers=bool(restarts),
                               server_timeout_s=min(300.0, settings.request_timeout_s),
                               transports=transports_by_rank())
    critic = None
    if run.critic:
        critic = built.stage("critic_train", CriticTrainStage, cfg, devices["critic"], built.start_step)
        built.stage("values", ValuesStage, critic)
    checkpointer = None
    if run.checkpoint.save_freq > 0:
        CheckpointDir(run.checkpoint.root).remove_partials()
        checkpointer = RunCheckpointer(run.checkpoint, steps, dataloader, sampling, critic, config=cfg)
    built.stage("actor_train", ActorTrainStage, cfg, devices["train"], eta, param_update,
                built.bucket_bytes["preduce"], compute_proximal=proximal == "train", start_step=built.start_step,
                checkpointer=checkpointer, kl_coef=state.kl_coef if state else None, critic_sink=critic)
    for spec in settings.user_stages:
        built.stage(spec.name, run.user_stages[spec.name], config=cfg, name=spec.name, **spec.kwargs)

    built.wait_for_stages()
    logger.warning("stage processes: %s", built.describe_processes())
    # engines start in parallel; each has its own timeout-bounded wait
    groups = ("actor_train", "logp", "ref_logp") + (("critic_train",) if run.critic else ())
    built.wait({n: built.stages[n].setup.remote() for n in groups}, SETUP_TIMEOUT_S, "start verl worker groups")
    # verl's agent loops with val_kwargs sampling; restarts and timeouts apply to validation too
    built.validator.generate = lambda rows, n: generate.run_agent_loops.remote(rows, n, None, True)
    upstreams = upstream_counts(run.edges)
    built.wait({name: built.stages[name].connect.remote([built.stages[d] for d in downstream], upstreams[name])
                for name, downstream in run.edges.items()}, CALL_TIMEOUT_S, "wire stages")


def check_weight_sync_room(built: BuiltPipeline) -> dict[str, int]:
    """Bucket sizes (bytes) after the start-time checks of param_update/capacity.py, for the links the
    placement will use (the driver runs on node 0 of the placement: train rank 0's)."""
    run, settings = built.run, built.run.async_cfg
    links = planned_links(run.placement, run.backend.receivers_tell_nodes, run.proximal_logp_workers == "logp")
    rooms = {cls.name: cls.room_bytes() for cls in transports_by_rank()}
    held = 2 if settings.enable_dual_buffer or settings.replica_max_restarts else 1
    return check_weight_sync(model_weight_bytes(run.config.actor_rollout_ref.model.path),
                             settings.preduce_bucket_size_mb, settings.consume_bucket_size_mb, held, links, rooms)


def start_weight_sync(built: BuiltPipeline) -> None:
    """Set every rollout receiver up for the trainer's layout (a mismatch fails here, at start) and give
    the generate stage the weight source of the servers it restarts."""
    trainer = built.stages["actor_train"]
    layout, built.adapter = built.wait({"actor_train": trainer.weight_layout.remote()}, CALL_TIMEOUT_S,
                                       "read the trainer's weight layout")["actor_train"]
    settings = built.run.async_cfg
    setup = built.stages["param_update"].configure_rollout_servers.remote(
        settings.enable_dual_buffer, built.bucket_bytes["consume"], layout, settings.partial_rollout, built.adapter)
    built.wait({"param_update": setup}, SETUP_TIMEOUT_S, "set up the rollout servers' weight staging")
    built.wait({"generate": built.stages["generate"].attach_weight_source.remote(built.stages["param_update"])},
               CALL_TIMEOUT_S, "attach the weight source for restarted rollout servers")


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
    loads = {"actor_train": built.stages["actor_train"].load_checkpoint.remote(point.path, delete)}
    if built.run.critic:
        loads["critic_train"] = built.stages["critic_train"].load_checkpoint.remote(point.path, delete)
    built.wait(loads, SETUP_TIMEOUT_S, f"load the checkpoint {point.path}")
    serve_weights(built, point.state.global_step)


def serve_weights(built: BuiltPipeline, step: int) -> None:
    """Sync the train ranks' weights (version `step`) to every receiver before anything generates."""
    built.wait({"param_update": built.stages["param_update"].process_data.remote(NewWeights(step, time.time())),
                "actor_train": built.stages["actor_train"].send_weights.remote()},
               SETUP_TIMEOUT_S, f"send the weights of step {step} to the rollout servers")


CLOSE_TIMEOUT_S = 10.0  # at shutdown, unlinking the weight sync's shared-memory files may take this long


def shutdown(built: BuiltPipeline) -> None:
    """Free the weight sync's shared memory, kill every stage and replica server (their worker groups go
    with them) and free the job's nodes. Best effort: what is already gone is what we wanted."""
    if "actor_train" in built.stages:
        try:
            ray.get(built.stages["actor_train"].close_weight_sender.remote(), timeout=CLOSE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a dead sender's files go at the next run's start
            logger.warning("the weight sync's shared-memory files were not unlinked; the next run removes them")
    for actor in [*built.actors(), *(s for r in built.replicas for s in r.servers)]:
        kill_actor(actor)
    if built.reward_model is not None:
        built.reward_model.stop()
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
    calls = {"actor_train": built.stages["actor_train"].weight_digests.remote()}
    if built.run.proximal_logp_workers == "logp":
        calls["logp"] = built.stages["logp"].weight_digests.remote()
    digests = built.wait(calls, CALL_TIMEOUT_S, "read weight digests")
    read = built.run.backend.read_digests
    if read is not None:
        # each replica's current server, a restarted one included
        handles = ray.get(built.stages["generate"].server_handles.remote(), timeout=CALL_TIMEOUT_S)
        names = [r.name for r in built.receivers if r.serves_generation]

        async def read_all():  # gather needs the running loop
            return await asyncio.wait_for(asyncio.gather(*(read(h) for h in handles)), CALL_TIMEOUT_S)

        digests.update(zip(names, asyncio.run(read_all())))
    return digests
