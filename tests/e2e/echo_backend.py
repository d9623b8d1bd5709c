"""A rollout backend written outside the package, one row and one registration (the contract of
async_rl/api/rollout.py): "echo" serves the CPU backend's servers, but starts them on random
weights (as verl's GPU servers start on dummy weights) and has its receivers read every version
through Ray's object store, even on the trainer's node. tests/e2e/test_a_new_backend.py runs it."""

from __future__ import annotations

import sys

import ray
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from async_rl.api.rollout import RolloutBackend, register_rollout_backend
from async_rl.rollout.cpu import backend as cpu
from param_update.receivers import ActorReceiver

# its receiver travels to the param_update stage's process, where this file is not importable: by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


async def start(replica, devices) -> None:
    """The CPU backend's server, then random weights in it (version 0 must be synced before it generates)."""
    await cpu.start(replica, devices)
    torch.manual_seed(1234 + replica.replica_rank)
    random = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(replica.model_config.local_path))
    await replica.server_handle.update_weights.remote(list(random.state_dict().items()), 0)


class StoreOnlyReceiver(ActorReceiver):
    async def nodes(self):
        return None  # node unknown: the object store, the transport that reaches every node


def receiver(index, replica, partial, replica_index):
    return StoreOnlyReceiver(f"echo_replica_{index}", replica.server_handle, True, replica_index=replica_index)


ECHO = register_rollout_backend(RolloutBackend(
    name="echo", start=start, make_receiver=receiver, read_digests=cpu.read_digests, waits_for_running=True,
    starts_on_dummy_weights=True, replica_class=cpu.CPURolloutReplica,
))
