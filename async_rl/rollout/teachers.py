"""On-policy distillation's teachers (`distillation.enabled=True`): verl's teacher replicas
(`is_teacher_model=True`), started once per run, verl's load balancer in front of each teacher, and the
client verl's agent loops use to score every training trajectory (prompt + response) with its teacher.

Each teacher runs as many replicas as verl's trainer starts for it (`DistillationConfig` derives
`num_replicas` from `distillation.n_gpus_per_node x nnodes` over one replica's tp x dp x pp), on the CPU
backend: one server process per replica on a logical CPU, none of the pipeline's devices. A teacher
request is bounded by the rollout request timeout; a lost teacher server fails the requests sent to it,
and the generate stage's error names it.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf, open_dict
from verl.utils.import_utils import resolve_config_path
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from async_rl.api.rollout import rollout_backend
from async_rl.core.errors import AsyncConfigError
from async_rl.rollout.cpu.replica import CPURolloutReplica
from async_rl.rollout.reward_models import free_replica
from async_rl.rollout.routing import check_router_file
from async_rl.rollout.supervisor import kill_actor
from async_rl.rollout.verl_replicas import start_standalone

TEACHER_BACKENDS = ("cpu",)  # `distillation.teacher_models.*.inference.name` the pipeline serves teachers on


def check_teachers(config, device: str) -> None:
    """Before Ray starts, with `distillation.enabled`: verl's own checks of the section (`DistillationConfig`:
    pool sizes, keys, loss mode), each teacher's model exists, its backend is one the pipeline serves
    teachers on, and its router file loads (AsyncConfigError naming the key)."""
    if not OmegaConf.select(config, "distillation.enabled", default=False):
        return
    try:
        teacher_models(config)
    except Exception as exc:  # noqa: BLE001 - verl's checks raise several kinds, wrapped by hydra's instantiate
        cause = exc.__cause__ or exc
        raise AsyncConfigError("distillation", "the section", f"one verl accepts ({type(cause).__name__}: {cause})") from exc
    for name, entry in config.distillation.teacher_models.items():
        if entry.get("model_path") is None:
            continue  # an entry verl drops (the default `teacher_model` beside named teachers)
        prefix = f"distillation.teacher_models.{name}"
        if not os.path.exists(str(entry.model_path)):
            raise FileNotFoundError(f"{prefix}.model_path={entry.model_path!r}: no such file or directory")
        backend = str(entry.inference.name)
        if backend not in TEACHER_BACKENDS:
            raise AsyncConfigError(f"{prefix}.inference.name", backend,
                                   f"one of {', '.join(TEACHER_BACKENDS)}: the backends the pipeline serves teachers "
                                   "on (a GPU server's teacher is not built yet)")
        rollout_backend(backend, device, f"{prefix}.inference.name")
        router = (entry.get("inference") or {}).get("router_config_path")
        if router:
            check_router_file(f"{prefix}.inference.router_config_path", str(router))


def absolute_teacher_paths(config) -> None:
    """The teachers' model and router paths made absolute, in place (Ray workers load them)."""
    if not OmegaConf.select(config, "distillation.enabled", default=False):
        return
    with open_dict(config):
        for entry in config.distillation.teacher_models.values():
            if entry.get("model_path") is not None:
                entry.model_path = os.path.abspath(str(entry.model_path))
            if (entry.get("inference") or {}).get("router_config_path"):
                entry.inference.router_config_path = resolve_config_path(str(entry.inference.router_config_path))


def teacher_models(config) -> dict:
    """verl's resolved teachers of `config.distillation`: routing key -> `DistillationTeacherModelConfig`
    (its `num_replicas` and `inference` as verl's trainer uses them); {} when distillation is off."""
    if not OmegaConf.select(config, "distillation.enabled", default=False):
        return {}
    from verl.utils.config import omega_conf_to_dataclass

    return dict(omega_conf_to_dataclass(config.distillation).teacher_models)


@dataclass
class TeacherService:
    """The run's teacher replicas, and verl's load balancer (a Ray actor) of each teacher, by routing key."""

    replicas: dict[str, list] = field(default_factory=dict)
    routers: dict[str, Any] = field(default_factory=dict)

    def stop(self) -> None:
        """Kill the teachers' servers and load balancers (idempotent)."""
        for replicas in self.replicas.values():
            for replica in replicas:
                free_replica(replica)
        for router in self.routers.values():
            kill_actor(router)


def start_teachers(config, timeout_s: float) -> TeacherService | None:
    """Start every teacher's replicas and verl's load balancer in front of them; None when distillation
    is off. TimeoutError naming the teacher's model when its servers are not up within `timeout_s` (s)."""
    teachers = teacher_models(config)
    if not teachers:
        return None
    from verl.workers.rollout.router import get_router_handle

    service = TeacherService()
    try:
        for key, teacher in teachers.items():
            model_config = OmegaConf.create({"_target_": "verl.workers.config.HFModelConfig", "path": teacher.model_path})
            replicas = [CPURolloutReplica(replica_rank=rank, config=teacher.inference, model_config=model_config,
                                          gpus_per_node=max(1, int(config.distillation.n_gpus_per_node)),
                                          is_teacher_model=True, name_suffix=str(key).replace("/", "_"))
                        for rank in range(int(teacher.num_replicas))]
            service.replicas[key] = replicas
            start_standalone(replicas, timeout_s, f"the distillation teacher {key!r} ({teacher.model_path})")
            service.routers[key] = get_router_handle(  # verl's, or the teacher's router_config_path's
                servers={replica._server_address: replica._server_handle for replica in replicas},
                router_config_path=teacher.inference.router_config_path)
    except BaseException:
        service.stop()
        raise
    return service


class TeacherClient(LLMServerClient):
    """verl's LLM client on a teacher's load balancer, each request bounded by `timeout_s` (s): a teacher
    that does not answer fails the trajectory with a TimeoutError naming the teacher."""

    def __init__(self, config, router, key: str, timeout_s: float):
        super().__init__(config, load_balancer_handle=router)
        self.key, self.timeout_s = key, timeout_s

    async def generate(self, request_id, **kwargs) -> TokenOutput:
        try:
            return await asyncio.wait_for(super().generate(request_id, **kwargs), timeout=self.timeout_s)
        except asyncio.TimeoutError as exc:
            raise TimeoutError(f"the distillation teacher {self.key!r} did not score a trajectory within "
                               f"{self.timeout_s:g} s (actor_rollout_ref.rollout.request_timeout_s)") from exc


def teacher_clients(config, routers: dict[str, Any], timeout_s: float) -> dict[str, TeacherClient] | None:
    """verl's `teacher_client` argument of `AgentLoopWorker`: a bounded client per teacher (None: no teacher)."""
    if not routers:
        return None
    return {key: TeacherClient(config, router, key, timeout_s) for key, router in routers.items()}
