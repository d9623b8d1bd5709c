"""The weight receiver of verl's replicas (param_update/receivers.py) with the vLLM backend's drain
(async_rl/rollout/vllm.py): how a load pauses a vLLM replica, with fakes of verl's server actors
(the real ones: tests/e2e/test_vllm_cpu_e2e.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import types

import pytest

from async_rl.api.weights import ReceiverSetup
from async_rl.rollout import vllm
from param_update.lora import AdaptedLinear, LoraAdapter
from param_update.receivers import VerlReplicaReceiver
from param_update.verl_engine import load_versions_as_adapter


class FakeServer:
    """What verl 0.9.1's vLLMHttpServer holds for its submission gate, and `__ray_call__`."""

    def __init__(self, running: int):
        self._submission_paused = False
        self._rejecting = True
        self._admitting = 0
        self._resume_event = asyncio.Event()
        self._resume_event.set()
        self.engine = types.SimpleNamespace(output_processor=types.SimpleNamespace(
            request_states={f"r{i}": None for i in range(running)}))
        outer = self

        class RayCall:
            @staticmethod
            async def remote(fn, *args):
                return fn(outer, *args)

        self.__ray_call__ = RayCall


class FakeWorker:
    def __init__(self, log):
        async def update(global_steps):
            log.append(("update", global_steps))

        self.update_weights = types.SimpleNamespace(remote=update)


class FakeReplica:
    def __init__(self, servers, log):
        self.servers, self.log = servers, log
        self.workers = [FakeWorker(log)]

    async def abort_all_requests(self):
        self.log.append(("abort", sum(len(s.engine.output_processor.request_states) for s in self.servers)))
        for s in self.servers:
            s.engine.output_processor.request_states.clear()

    async def resume_generation(self):
        self.log.append(("resume", None))
        for s in self.servers:
            s._submission_paused = False
            s._resume_event.set()


def test_partial_rollout_false_parks_new_requests_and_loads_after_the_running_ones_finish():
    log = []
    server = FakeServer(running=3)
    receiver = vllm.receiver(0, FakeReplica([server], log), partial=False, replica_index=None)

    async def main():
        async def requests_finish():
            while server.engine.output_processor.request_states:
                await asyncio.sleep(0.02)
                assert server._submission_paused and not server._resume_event.is_set()  # new ones parked
                assert not log  # nothing loads while a request runs
                server.engine.output_processor.request_states.popitem()
                log_finished.append(len(server.engine.output_processor.request_states))

        log_finished = []
        await asyncio.gather(requests_finish(), receiver.commit(version=5, num_buckets=1))
        return log_finished

    finished = asyncio.run(asyncio.wait_for(main(), 10))
    assert finished == [2, 1, 0]
    assert log == [("update", 5), ("resume", None)]  # no abort: the three ran to their end
    assert not server._rejecting  # parked, not rejected
    assert not server._submission_paused and server._resume_event.is_set()


def test_partial_rollout_true_aborts_then_loads():
    log = []
    receiver = vllm.receiver(0, FakeReplica([FakeServer(running=2)], log), partial=True, replica_index=None)
    asyncio.run(asyncio.wait_for(receiver.commit(version=1, num_buckets=1), 10))
    assert log == [("abort", 2), ("update", 1), ("resume", None)]


def test_a_request_that_never_finishes_fails_the_load_naming_the_replica(monkeypatch):
    monkeypatch.setattr(vllm, "DRAIN_TIMEOUT_S", 0.1)
    log, server = [], FakeServer(running=1)
    receiver = vllm.receiver(3, FakeReplica([server], log), partial=False, replica_index=None)
    with pytest.raises(TimeoutError, match="rollout_replica_3: running requests did not finish within 0.1 s"):
        asyncio.run(asyncio.wait_for(receiver.commit(version=1, num_buckets=1), 10))
    assert log == [("resume", None)] and not server._submission_paused  # nothing loaded; the gate reopened


def test_a_backend_that_cannot_wait_refuses_partial_rollout_false():
    with pytest.raises(ValueError, match="rollout_replica_0: partial_rollout=False needs a backend that can wait"):
        VerlReplicaReceiver("rollout_replica_0", FakeReplica([FakeServer(running=0)], []), partial=False)


def test_partial_rollout_false_is_refused_for_sglang(demo_dir):
    from async_rl import run_config
    from async_rl.api.rollout import register_rollout_backend, rollout_backend
    from async_rl.core.errors import AsyncConfigError
    from async_rl.demo import demo_overrides
    from helpers.lineage import compose_ppo

    sglang = rollout_backend("sglang")
    register_rollout_backend(dataclasses.replace(sglang, unavailable=lambda device: None))  # not installed here
    try:
        config = compose_ppo(demo_overrides(demo_dir, extra={
            "actor_rollout_ref.rollout.name": "sglang", "+actor_rollout_ref.rollout.partial_rollout": False}))
        with pytest.raises(AsyncConfigError, match="partial_rollout.*sglang"):
            run_config.read_run_config(config)
    finally:
        register_rollout_backend(sglang)


class FakeServerAdapter:
    """verl's vLLM ServerAdapter as `CheckpointEngineWorker.update_weights` calls it."""

    def __init__(self):
        self.calls = []

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors", **kwargs):
        self.calls.append((list(weights), global_steps, kwargs))


def test_under_lora_every_version_loads_as_an_adapter_with_verls_arguments():
    """verl's worker passes its server adapter no LoRA arguments; once configured with an adapter, the replica's
    workers load each version with PEFT's config and `base_sync_done=True` (vLLM's add_lora path)."""
    peft_config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    adapter = LoraAdapter((AdaptedLinear("m.q_proj.weight", "a", "b", 2.0),), peft_config=peft_config)
    worker = types.SimpleNamespace(server_adapter=FakeServerAdapter(), configured=[])

    class RayCall:  # Ray's `__ray_call__`: fn(actor, *args)
        @staticmethod
        async def remote(fn, *args):
            return fn(worker, *args)

    async def update(global_steps):  # verl's CheckpointEngineWorker.update_weights
        await worker.server_adapter.update_weights(iter([("a", 1), ("b", 2)]), global_steps=global_steps,
                                                   wire_format="named_tensors")

    async def execute(method, *args):
        worker.configured.append(method)

    worker.__ray_call__ = RayCall
    worker.update_weights = types.SimpleNamespace(remote=update)
    worker.execute_checkpoint_engine = types.SimpleNamespace(remote=execute)
    replica = FakeReplica([FakeServer(running=0)], [])
    replica.workers = [worker]
    receiver = vllm.receiver(0, replica, partial=True, replica_index=None)

    async def main():
        await receiver.configure(ReceiverSetup(True, 1 << 20, {"a": None, "b": None}, adapter=adapter))
        await receiver.configure(ReceiverSetup(True, 1 << 20, {"a": None, "b": None}, adapter=adapter))  # a restart: no double wrap
        await receiver.commit(version=4, num_buckets=1)

    asyncio.run(asyncio.wait_for(main(), 10))
    assert worker.configured == ["configure", "configure"]
    assert worker.server_adapter.calls == [([("a", 1), ("b", 2)], 4, {"peft_config": peft_config, "base_sync_done": True})]


def test_an_adapter_without_its_peft_config_is_refused_naming_the_replica():
    adapter = LoraAdapter((AdaptedLinear("m.q_proj.weight", "a", "b", 2.0),))
    receiver = vllm.receiver(2, FakeReplica([FakeServer(running=0)], []), partial=True, replica_index=None)
    with pytest.raises(ValueError, match="rollout_replica_2: the adapter has no PEFT config"):
        asyncio.run(receiver.configure(ReceiverSetup(True, 1 << 20, None, adapter=adapter)))


def test_lora_on_vllm_loads_the_base_from_the_model_path_and_keeps_a_users_load_format():
    from omegaconf import OmegaConf

    def config(lora_rank, load_format):
        return OmegaConf.create({"actor_rollout_ref": {"model": {"lora_rank": lora_rank},
                                                       "rollout": {"load_format": load_format}}})

    lora = config(8, "dummy")
    assert vllm.base_weights_from_path(lora) and lora.actor_rollout_ref.rollout.load_format == "auto"
    for lora_rank, load_format in [(0, "dummy"), (8, "safetensors")]:
        kept = config(lora_rank, load_format)
        assert not vllm.base_weights_from_path(kept)
        assert kept.actor_rollout_ref.rollout.load_format == load_format
