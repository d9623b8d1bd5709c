"""Building the pipeline: Ray, every stage as a Ray actor, their verl worker groups, the weight
sync's receivers, the wiring of the stage graph and the resume from a checkpoint.

`PipelineBuild` is the building half of `async_rl.pipeline.AsyncPipeline` (which inherits
it); its `_wait` (results of stage calls within a deadline, in s, stopping on a stop signal)
serves the running half too.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import ray

from async_rl.run_config import ray_init_kwargs
from async_rl.stage_graph import upstream_counts
from async_rl.stop_signals import PipelinePreempted

logger = logging.getLogger(__name__)

SETUP_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 120.0


class PipelineError(RuntimeError):
    """The pipeline stopped: a stage failed, stalled, or could not start."""


class PipelineBuild:
    """Starts Ray and the stage actors, wires them, and loads a resume point. Inherited by
    `AsyncPipeline`, whose constructor sets what it reads (`config`, `async_cfg`, `checkpoint_cfg`,
    `critic`, `edges`, `total_steps`, `_stop_request`, `_training`) and what it fills (`stages`,
    `replicas`, `receivers`, `validator`)."""

    def _start_ray(self) -> None:
        if str(self.config.trainer.device) == "cpu":
            from verl_patches.cpu_patches import set_engine_device_env, use_cpu_platform

            use_cpu_platform()
            set_engine_device_env()
        self._ray_kwargs = ray_init_kwargs(self.config)
        if not ray.is_initialized():
            ray.init(**self._ray_kwargs)
            self._owns_ray = True
        else:
            self._owns_ray = False
        self.driver_node = ray.get_runtime_context().get_node_id()

    def _stage(self, stage_name: str, cls, *args, **kwargs):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor_cls = ray.remote(cls).options(
            name=f"async_rl_{stage_name}_{os.getpid()}",
            num_cpus=0,
            max_concurrency=64,
            runtime_env={"env_vars": self._ray_kwargs["runtime_env"]["env_vars"]},
            scheduling_strategy=NodeAffinitySchedulingStrategy(self.stage_nodes.get(stage_name, self.driver_node), False),
        )
        handle = actor_cls.remote(*args, **kwargs)
        self.stages[stage_name] = handle
        return handle

    def build(self) -> None:
        from state_machines.actor_train import ActorTrainStage
        from state_machines.dataloader import DataloaderStage
        from state_machines.generate import GenerateStage
        from state_machines.logp import LogpStage
        from state_machines.param_update import ParamUpdateStage
        from state_machines.ref_logp import RefLogpStage
        from state_machines.reward import RewardStage
        from state_machines.rollout import RolloutStage
        from verl.trainer.ppo.utils import need_reference_policy
        from verl.utils import hf_tokenizer

        from async_rl.checkpoints import CheckpointDir, RunCheckpointer
        from async_rl.rollout_backends import launch_rollout_replicas, make_rollout_replicas
        from async_rl.validation import Validator

        cfg = self.config
        proximal = self.proximal_logp_workers()
        devices = self._reserve_devices()
        sizes = self.world_sizes = {role: d.world_size for role, d in devices.items() if role != "generate"}
        tokenizer = hf_tokenizer(cfg.actor_rollout_ref.model.path, trust_remote_code=False)
        replicas = make_rollout_replicas(cfg, len(devices["generate"]))
        self.replicas = launch_rollout_replicas(replicas, cfg.actor_rollout_ref.rollout.name, SETUP_TIMEOUT_S,
                                                devices["generate"])
        servers = [r.server_handle for r in self.replicas]
        self.validator = Validator(cfg, tokenizer, servers, self.async_cfg.reward_timeout_s,
                                   self.async_cfg.reward_on_error)
        steps = self.total_steps
        eta = self.async_cfg.max_staleness
        rollout_cfg = cfg.actor_rollout_ref.rollout
        resume = self.resume_point = self._find_resume_point(sizes["train"])
        state = resume.state if resume is not None else None
        self.start_step = state.global_step if state is not None else 0

        refill = self.async_cfg.dynamic_sampling  # draws prompts until the training batches are full
        sampling = None
        dataloader = self._stage("dataloader", DataloaderStage, cfg, tokenizer, None if refill else steps,
                                 state.generated_batches if state else 0, state.dataloader_state if state else None)
        restarts = self.async_cfg.replica_max_restarts
        generate = self._stage("generate", GenerateStage, servers, rollout_cfg, eta,
                               request_timeout_s=self.async_cfg.request_timeout_s, dynamic_sampling=refill,
                               steps_formed=self.start_step, replicas=self.replicas if restarts else None,
                               max_restarts=restarts)
        self._stage(
            "rollout", RolloutStage, int(cfg.data.max_prompt_length), int(rollout_cfg.response_length),
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        )
        self._stage("reward", RewardStage, cfg, tokenizer, self.async_cfg.reward_timeout_s,
                    self.async_cfg.reward_on_error)
        if refill:
            from state_machines.dynamic_sampling import DynamicSamplingStage

            sampling = self._stage("dynamic_sampling", DynamicSamplingStage, cfg, eta, steps, generate, dataloader,
                                   self.start_step, state.generated_batches if state else 0,
                                   state.sampling_pool if state else None)
        bucket_bytes = self._check_weight_sync()
        dual = self.async_cfg.enable_dual_buffer
        logp = self._stage("logp", LogpStage, cfg, devices.get("logp", 0), bucket_bytes["consume"],
                           compute=proximal == "logp")
        self._stage("ref_logp", RefLogpStage, cfg, devices.get("ref_logp", 0), need_reference_policy(cfg))
        receivers = self._weight_receivers(logp if proximal == "logp" else None)
        param_update = self._stage("param_update", ParamUpdateStage, receivers, generate,
                                   restartable_servers=bool(restarts),
                                   server_timeout_s=min(300.0, self.async_cfg.request_timeout_s))
        critic = None
        if self.critic:
            from state_machines.critic_train import CriticTrainStage
            from state_machines.values import ValuesStage

            critic = self._stage("critic_train", CriticTrainStage, cfg, devices["critic"], self.start_step)
            self._stage("values", ValuesStage, critic)
        checkpointer = None
        if self.checkpoint_cfg.save_freq > 0:
            CheckpointDir(self.checkpoint_cfg.root).remove_partials()
            checkpointer = RunCheckpointer(self.checkpoint_cfg, steps, dataloader, sampling, critic)
        self._stage("actor_train", ActorTrainStage, cfg, devices["train"], eta, param_update, bucket_bytes["preduce"],
                    compute_proximal=proximal == "train", start_step=self.start_step, checkpointer=checkpointer,
                    kl_coef=state.kl_coef if state else None, critic_sink=critic)
        for spec in self.async_cfg.user_stages:
            self._stage(spec.name, spec.load_class(), config=cfg, name=spec.name, **spec.kwargs)

        # engines start in parallel; each has its own timeout-bounded wait
        groups = ("actor_train", "logp", "ref_logp") + (("critic_train",) if self.critic else ())
        self._wait({n: self.stages[n].setup.remote() for n in groups}, SETUP_TIMEOUT_S, "start verl worker groups")
        self.validator.generate_stage = generate  # restarts and timeouts apply to validation too
        self._configure_receivers(dual, bucket_bytes["consume"])
        self._wait({"generate": generate.attach_weight_source.remote(param_update)}, CALL_TIMEOUT_S,
                   "attach the weight source for restarted rollout servers")
        self._wire()
        if resume is not None:
            self._load_resume_point(resume)
        elif str(cfg.actor_rollout_ref.rollout.name) != "cpu":  # verl's servers start on dummy weights: serve step 0
            self._serve_weights(0)

    def plan_placement(self):
        """Where every worker group and replica goes (async_rl/placement.py); config only, no Ray:
        a split that cannot work fails before Ray starts."""
        from verl.trainer.ppo.utils import need_reference_policy

        from async_rl.placement import plan_placement
        from async_rl.rollout_backends import replica_world_size

        cfg = self.config
        rollout_cfg = cfg.actor_rollout_ref.rollout
        roles = (["train"] + (["critic"] if self.critic else []) + (["logp"] if self.proximal_logp_workers() == "logp"
                 else []) + (["ref_logp"] if need_reference_policy(cfg) else []))
        return plan_placement(int(cfg.trainer.nnodes), int(cfg.trainer.n_gpus_per_node), self.async_cfg.ratios_by_role,
                              roles, 1 if str(rollout_cfg.name) == "cpu" else replica_world_size(rollout_cfg))

    def _reserve_devices(self) -> dict:
        """Reserve the job's nodes for `self.placement` and pick each stage actor's node; returns role ->
        GroupDevices, and "generate" -> one GroupDevices per rollout replica."""
        from async_rl.resources import GroupDevices, reserve_nodes

        plan, per_node = self.placement, self.placement.devices_per_node
        groups, node_ids = reserve_nodes(plan, str(self.config.trainer.device) == "cpu", SETUP_TIMEOUT_S)
        self.node_groups = groups
        logger.warning("placement: %s", plan.describe())
        devices = {role: GroupDevices(groups, r, per_node, plan.colocate_count) for role, r in plan.groups.items()}
        devices["generate"] = [GroupDevices(groups, r, per_node) for r in plan.replicas]
        node_of = {role: node_ids[r.start // per_node] for role, r in plan.groups.items()}
        self.stage_nodes = {"actor_train": node_of["train"], "param_update": node_of["train"],
                            "generate": node_ids[plan.replicas[0].start // per_node]}
        self.stage_nodes.update({stage: node_of[role] for stage, role in
                                 (("logp", "logp"), ("ref_logp", "ref_logp"), ("critic_train", "critic"),
                                  ("values", "critic")) if role in node_of})
        return devices

    def _find_resume_point(self, train_world_size: int):
        """The checkpoint this run continues from (verl's resume_mode rules), or None."""
        from async_rl.checkpoints import find_resume_point

        workers = int(self.config.data.get("dataloader_num_workers", 0) or 0)
        return find_resume_point(self.checkpoint_cfg, train_world_size, workers, self.async_cfg.dynamic_sampling,
                                 self.world_sizes["critic"] if self.critic else None)

    def _load_resume_point(self, resume) -> None:
        """Load the checkpoint into the train ranks and serve its weights before anything generates."""
        step = resume.state.global_step
        logger.warning("resuming from %s (step %d, written by %s)", resume.path, step, resume.written_by)
        loads = {"actor_train": self.stages["actor_train"].load_checkpoint.remote(
            resume.path, self.checkpoint_cfg.del_local_after_load)}
        if self.critic:
            loads["critic_train"] = self.stages["critic_train"].load_checkpoint.remote(
                resume.path, self.checkpoint_cfg.del_local_after_load)
        self._wait(loads, SETUP_TIMEOUT_S, f"load the checkpoint {resume.path}")
        self._serve_weights(step)

    def _serve_weights(self, step: int) -> None:
        """Sync the train ranks' weights (version `step`) to every receiver before anything generates."""
        from state_machines.param_update import NewWeights

        self._wait({"param_update": self.stages["param_update"].process_data.remote(NewWeights(step, time.time())),
                    "actor_train": self.stages["actor_train"].send_weights.remote()},
                   SETUP_TIMEOUT_S, f"send the weights of step {step} to the rollout servers")

    def proximal_logp_workers(self) -> str | None:
        """Which workers recompute pi_prox: "train", "logp", or None (verl's bypass mode: none do)."""
        from async_rl.decoupled_ppo import uses_behaviour_as_old

        return None if uses_behaviour_as_old(self.config) else self.async_cfg.proximal_logp_workers

    def _weight_receivers(self, logp) -> list:
        """The weight sync's receivers: every rollout replica, then the logp stage if it computes."""
        from param_update.checkpoint_engine import GPUReplicaReceiver
        from param_update.overlapped import ActorReceiver

        on_cpu = str(self.config.actor_rollout_ref.rollout.name) == "cpu"
        restartable = bool(self.async_cfg.replica_max_restarts)
        rollout = [
            ActorReceiver(f"rollout_server_{i}", r.server_handle, True, replica_index=i if restartable else None)
            if on_cpu
            else GPUReplicaReceiver(f"rollout_replica_{i}", r, self.async_cfg.partial_rollout,
                                    replica_index=i if restartable else None)
            for i, r in enumerate(self.replicas)
        ]
        self.receivers = rollout + ([ActorReceiver("logp", logp, False)] if logp is not None else [])
        return self.receivers

    def _configure_receivers(self, dual: bool, consume_bytes: int) -> None:
        """Set every rollout receiver up for the trainer's layout (a mismatch fails here, at start)."""
        layout = ray.get(self.stages["actor_train"].weight_layout.remote(), timeout=CALL_TIMEOUT_S)
        setup = self.stages["param_update"].configure_rollout_servers.remote(
            dual, consume_bytes, layout, self.async_cfg.partial_rollout)
        self._wait({"param_update": setup}, SETUP_TIMEOUT_S, "set up the rollout servers' weight staging")

    def _check_weight_sync(self) -> dict[str, int]:
        """Bucket sizes (bytes) after the start-time checks of param_update/capacity.py."""
        from param_update.capacity import check_weight_sync, model_weight_bytes, weight_links
        from param_update.shared_buffer import shm_free_bytes

        store = ray.cluster_resources().get("object_store_memory")
        links = weight_links(self.placement, str(self.config.actor_rollout_ref.rollout.name) == "cpu",
                             self.proximal_logp_workers() == "logp")
        return check_weight_sync(
            model_weight_bytes(self.config.actor_rollout_ref.model.path),
            self.async_cfg.preduce_bucket_size_mb,
            self.async_cfg.consume_bucket_size_mb,
            self.async_cfg.enable_dual_buffer,
            int(store) if store else None,
            retain_newest=bool(self.async_cfg.replica_max_restarts),
            links=frozenset(links),
            shm_free_bytes=shm_free_bytes(),  # the driver runs on node 0 of the placement: train rank 0's
        )

    def _wire(self) -> None:
        """Connect every stage to its downstreams (`self.edges`)."""
        upstreams = upstream_counts(self.edges)
        calls = {
            name: self.stages[name].connect.remote([self.stages[d] for d in downstream], upstreams[name])
            for name, downstream in self.edges.items()
        }
        self._wait(calls, CALL_TIMEOUT_S, "wire stages")

    def _wait(self, refs: dict[str, Any], timeout_s: float, what: str) -> dict[str, Any]:
        """Results of `refs` (name -> ObjectRef); PipelineError naming the late or failed ones, PipelinePreempted
        on a stop signal meanwhile."""
        names = list(refs)
        deadline = time.monotonic() + timeout_s
        pending = list(refs.values())
        while pending:
            self._raise_if_stop_requested(f"while waiting to {what}")
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(1.0, max(deadline - time.monotonic(), 0)))
            if pending and time.monotonic() >= deadline:
                late = [n for n, r in refs.items() if r in pending]
                raise PipelineError(f"timed out after {timeout_s:g} s waiting to {what}: {late}")
        try:
            return dict(zip(names, ray.get(list(refs.values()), timeout=timeout_s)))
        except ray.exceptions.RayError as exc:
            raise PipelineError(f"failed to {what}: {exc}") from exc

    def _raise_if_stop_requested(self, where: str) -> None:
        """Before training starts a stop signal has nothing to save: stop at once (after, the loop
        stops at a step boundary with a checkpoint)."""
        if self._stop_request is not None and self._stop_request.requested and not self._training:
            raise PipelinePreempted(self._stop_request.signum, None, where)
