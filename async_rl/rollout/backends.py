"""The rollout backends the pipeline knows, one row each (async_rl/api/rollout.py); importing this
module registers them. A new backend is one module and one `register_rollout_backend` call."""

from __future__ import annotations

from async_rl.api.rollout import RolloutBackend, register_rollout_backend
from async_rl.rollout import sglang, verl_replicas, vllm
from async_rl.rollout.cpu import backend as cpu
from async_rl.rollout.vllm_digests import replica_weight_digests

CPU = register_rollout_backend(RolloutBackend(
    name="cpu", start=cpu.start, make_receiver=cpu.receiver, relaunch=cpu.relaunch, read_digests=cpu.read_digests,
    waits_for_running=True, default_max_restarts=3, receivers_tell_nodes=True, replica_class=cpu.CPURolloutReplica,
    serves_images=True, prepare_config=cpu.check_config, loads_deltas=True,
))
VLLM = register_rollout_backend(RolloutBackend(
    name="vllm", start=verl_replicas.start_on_devices, make_receiver=vllm.receiver,
    relaunch=verl_replicas.relaunch_on_devices, read_digests=replica_weight_digests, waits_for_running=True,
    starts_on_dummy_weights=True, replica_world_size=verl_replicas.replica_world_size, unavailable=vllm.unavailable,
    prepare_config=vllm.prepare_config, prepare_server_config=vllm.prepare_server_config, ray_env=vllm.ray_env,
    logical_gpus_on_cpu=True, gpu_server=True, loads_deltas=True,
))
SGLANG = register_rollout_backend(RolloutBackend(
    name="sglang", start=verl_replicas.start_on_devices, make_receiver=verl_replicas.receiver,
    starts_on_dummy_weights=True, replica_world_size=verl_replicas.replica_world_size,
    unavailable=sglang.unavailable, prepare_config=sglang.prepare_config,
    prepare_server_config=sglang.prepare_server_config, ray_env=sglang.ray_env, logical_gpus_on_cpu=True, gpu_server=True,
))
TRTLLM = register_rollout_backend(RolloutBackend(
    name="trtllm", start=verl_replicas.start_on_devices, make_receiver=verl_replicas.receiver,
    starts_on_dummy_weights=True, replica_world_size=verl_replicas.replica_world_size,
    unavailable=verl_replicas.trtllm_unavailable, prepare_config=verl_replicas.prepare_config, gpu_server=True,
))
