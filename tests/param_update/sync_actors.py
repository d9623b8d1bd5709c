"""What the weight-sync tests share (test_sync_*.py, test_transports.py, test_a_new_transport.py): a
trainer actor that sends its tiny model as a train rank does, a stand-in for the generate stage, and
helpers that start a CPU rollout server and a param_update stage and sync a version through them.

Ray pickles them by value (this module is not on the workers' path)."""

from __future__ import annotations

import os
import sys
import time

import ray
import torch
import transformers
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.workers.config import HFModelConfig, RolloutConfig

from async_rl.core.messages import NewWeights
from async_rl.rollout.cpu.server import CPURolloutServer
from param_update.buckets import tensor_digest
from param_update.receivers import ActorReceiver
from state_machines.param_update import ParamUpdateStage
from helpers.clusters import RAY_CALL_GUARD_S

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def tiny_model(seed: int):
    config = transformers.Qwen2Config(
        vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(config).eval()


def digests(state: dict) -> dict:
    return {name: tensor_digest(t) for name, t in state.items()}


@ray.remote
class Trainer:
    """Holds a model and sends it the way the train workers do (BucketSender); counts its `ray.put` calls."""

    def __init__(self, seed: int):
        from param_update.sender import BucketSender

        self.model = tiny_model(seed)
        self.sender = BucketSender()
        self.puts = 0
        put = ray.put

        def counting_put(*args, **kwargs):
            self.puts += 1
            return put(*args, **kwargs)

        ray.put = counting_put

    def send(self, version: int, bucket_bytes: int, sink) -> dict:
        from param_update.sender import live_storage_addresses

        state = self.model.state_dict()
        return self.sender.gather_and_send(state.items(), version, bucket_bytes, sink, True,
                                           live_storage_addresses(state.values()))

    def digests(self) -> dict:
        return digests(self.model.state_dict())

    def step(self) -> None:
        """What the next training step does to the weights while the buckets still travel."""
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(1.0)

    def nudge(self, fraction: float, seed: int) -> None:
        """A step that moves `fraction` of each tensor's values (a delta sync's case)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_((torch.rand(p.shape, generator=g) < fraction) * 0.05)

    def put_count(self) -> int:
        return self.puts

    def files(self) -> list:
        """The sender's shared-memory files (none before its first same-node write)."""
        shm = self.sender._transports.get("shm")
        if shm is None or shm._buffer is None:
            return []
        directory, name = os.path.split(shm._buffer.prefix)
        return sorted(f for f in os.listdir(directory) if f.startswith(name))

    def close(self) -> None:
        self.sender.close()


@ray.remote
class VersionLog:
    """Stands in for the policy clock: records `set_served_version` and `report_lost` calls."""

    def __init__(self):
        self.versions = []
        self.losses = []

    def set_served_version(self, version: int) -> None:
        self.versions.append(version)

    def report_lost(self, index: int, handle, cause: str, hung: bool = False) -> None:
        self.losses.append((index, cause))

    def get(self) -> list:
        return self.versions

    def lost(self) -> list:
        return self.losses


TIMEOUT_S = RAY_CALL_GUARD_S  # a hang guard, not a bound on how long a call takes


def on_node(node_id):
    return {} if node_id is None else {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def start_server(model_dir: str, dual: bool, node_id=None, configure: bool = True):
    """A CPU rollout server of the tiny model in `model_dir`, its staging set up (`configure`)."""
    config = RolloutConfig(name="cpu", tensor_model_parallel_size=1, prompt_length=8, response_length=8)
    server = ray.remote(CPURolloutServer).options(max_concurrency=64, num_cpus=1, **on_node(node_id)).remote(
        config=config, model_config=HFModelConfig(path=model_dir, load_tokenizer=False))
    ray.get(server.launch_server.remote(), timeout=TIMEOUT_S)
    if configure:
        ray.get(server.configure_weight_sync.remote(dual, 4096), timeout=TIMEOUT_S)
    return server


def start_stage(servers, restartable: bool = False, node_id=None, transports=None, log=None):
    """A running param_update stage syncing `servers` (`transports`: its transport classes, default the
    registered ones; `log`: the VersionLog standing in for the generate stage)."""
    receivers = [ActorReceiver(f"rollout_server_{i}", s, True, replica_index=i if restartable else None)
                 for i, s in enumerate(servers)]
    stage = ray.remote(ParamUpdateStage).options(max_concurrency=64, num_cpus=0, **on_node(node_id)).remote(
        receivers=receivers, clock=log or VersionLog.remote(), restartable_servers=restartable, transports=transports)
    ray.get(stage.connect.remote([], 1), timeout=TIMEOUT_S)
    stage.run.remote()
    return stage


def sync(stage, trainer, version: int, bucket_bytes: int = 2048) -> dict:
    """One version through the stage; its metrics."""
    ray.get(stage.put.remote(NewWeights(version, time.time())), timeout=TIMEOUT_S)
    ray.get(trainer.send.remote(version, bucket_bytes, stage), timeout=TIMEOUT_S)
    return wait_for_timings(stage, version)


def wait_for_timings(stage, version: int) -> dict:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        timings = ray.get(stage.pop_timings.remote(), timeout=TIMEOUT_S).get(version)
        if timings is not None:
            return timings
        time.sleep(0.05)
    raise TimeoutError(f"version {version} was not synced within {TIMEOUT_S} s")


def served(server) -> tuple[int, dict]:
    """(version, digests) a server serves."""
    return (ray.get(server.get_param_version.remote(), timeout=TIMEOUT_S),
            ray.get(server.weight_digests.remote(), timeout=TIMEOUT_S))
