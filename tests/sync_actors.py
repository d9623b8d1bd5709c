"""Ray actors the weight-sync tests share (tests/test_param_update_sync.py, tests/test_weight_transport.py):
a trainer that sends its tiny model as a train rank does, and a stand-in for the generate stage.

Ray pickles them by value (this module is not on the workers' path)."""

from __future__ import annotations

import os
import sys

import ray
import torch
import transformers

from param_update.buckets import tensor_digest

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

    def put_count(self) -> int:
        return self.puts

    def files(self) -> list:
        """The sender's shared-memory files."""
        directory, name = os.path.split(self.sender._buffer.prefix)
        return sorted(f for f in os.listdir(directory) if f.startswith(name))

    def close(self) -> None:
        self.sender.close()


@ray.remote
class VersionLog:
    """Stands in for the generate stage: records `set_served_version` calls."""

    def __init__(self):
        self.versions = []

    def set_served_version(self, version: int) -> None:
        self.versions.append(version)

    def get(self) -> list:
        return self.versions
