"""The transport contract (async_rl/api/weights.py) proven by extension: a weight transport written here,
one class and one `register_transport` call, carries a version from the trainer's send thread through
the param_update stage to a CPU rollout server, bit for bit, and nothing goes through the built-in
transports."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import ray
from sync_actors import TIMEOUT_S, Trainer, served, start_server, start_stage, sync, tiny_model

from async_rl.api.weights import (
    WeightTransport,
    link_of,
    register_transport,
    transports_by_rank,
    unregister_transport,
)

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the fake travels to Ray's workers by value


@dataclass(frozen=True)
class FileBucket:
    path: str

    def read(self, slices: list) -> list:
        flat = np.fromfile(self.path, dtype=np.uint8)
        ends = np.cumsum([0] + [s.nbytes for s in slices])
        return [flat[start:end] for start, end in zip(ends[:-1], ends[1:])]


class FileTransport(WeightTransport):
    """Each bucket written as one file into the directory the param_update stage names (its ticket)."""

    name: ClassVar[str] = "file"
    rank: ClassVar[int] = -1  # preferred over the built-in transports
    directory: ClassVar[str] = ""

    @classmethod
    def reaches(cls, receiver_nodes, sender_node) -> bool:
        return True  # one machine here

    async def open(self, version: int, timeout_s: float) -> str:
        return self.directory

    def write(self, ticket: str, bucket, pool=None, parts: int = 1) -> FileBucket:
        path = os.path.join(ticket, f"v{bucket.version}-b{bucket.index}")
        (np.concatenate(bucket.data) if bucket.data else np.empty(0, np.uint8)).tofile(path)
        return FileBucket(path)


@pytest.fixture
def file_transport(tmp_path):
    FileTransport.directory = str(tmp_path)
    register_transport(FileTransport)
    yield tmp_path
    unregister_transport(FileTransport.name)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("new_transport_model")
    tiny_model(0).save_pretrained(path)
    return str(path)


def test_a_registered_transport_becomes_every_receivers_link(file_transport):
    assert transports_by_rank()[0] is FileTransport
    assert link_of(["node-a"], "node-a") == link_of(None, "node-a") == "file"


def test_a_new_transport_carries_a_version_bit_for_bit(small_objects_ray, file_transport, model_dir):
    server = start_server(model_dir, dual=True)
    stage = start_stage([server], transports=transports_by_rank())
    trainer = Trainer.remote(seed=1)
    timings = sync(stage, trainer, 1)
    assert served(server) == (1, ray.get(trainer.digests.remote(), timeout=TIMEOUT_S))
    assert timings["async/param_update/file_receivers"] == 1.0
    assert timings["async/param_update/shm_receivers"] == timings["async/param_update/store_receivers"] == 0.0
    assert set(os.listdir(file_transport)) == {f"v1-b{i}" for i in range(int(timings["async/param_update/num_buckets"]))}
    assert ray.get(trainer.put_count.remote(), timeout=TIMEOUT_S) == 0  # nothing through the object store
    assert ray.get(trainer.files.remote(), timeout=TIMEOUT_S) == []  # nor shared memory


def test_the_fallback_is_a_property_of_the_table(file_transport):
    """The table's fallback is its last transport that reaches receivers on unknown nodes (it carries
    buckets a receiver's link did not get); a table without one is refused when made."""
    from async_rl.api.weights import TransportTable
    from param_update.transports.object_store import ObjectStore
    from param_update.transports.shared_memory import SharedMemory

    table = TransportTable()
    assert table.classes[0] is FileTransport and table.fallback is ObjectStore
    assert TransportTable([FileTransport]).fallback is FileTransport
    with pytest.raises(ValueError, match="no weight transport of \\['shm'\\] reaches a receiver on unknown nodes"):
        TransportTable([SharedMemory])
