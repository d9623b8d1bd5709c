"""The collective transport's receive buffers (param_update/transports/receive_buffers.py): memory a
version is received into is handed out again only once nothing views it, so the weights a receiver
serves are never overwritten, and a dual-buffer load frees nothing."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import transformers

from async_rl.api.weights import Bucket
from param_update.buckets import pack_buckets
from param_update.buckets import tensor_digest as digest
from param_update.staging import VersionStager, weight_layout
from param_update.transports.receive_buffers import ReceiveBuffers


def address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_a_viewed_buffer_is_not_handed_out_and_a_dropped_one_is():
    pool = ReceiveBuffers()
    first = pool.take(100)
    served = torch.from_numpy(first[10:20])  # a tensor over a slice, as a swapped-in weight
    where = address(first)
    del first
    second = pool.take(100)
    assert address(second) != where  # the served tensor still views the first buffer
    del served
    third = pool.take(100)
    assert address(third) == where  # nothing views it any more: received into again
    assert pool.held_bytes == 200


def test_a_smaller_take_reuses_a_larger_free_buffer_and_a_larger_one_replaces_smaller_free_ones():
    pool = ReceiveBuffers()
    big = pool.take(1000)
    where = address(big)
    del big
    small = pool.take(300)  # a delta's smaller bucket: a view of the free buffer
    assert address(small) == where and small.nbytes == 300
    del small
    kept = pool.take(10)
    larger = pool.take(5000)  # the 1000-byte buffer is in use (kept): it stays, no free one is smaller
    assert pool.held_bytes == 6000
    del kept, larger
    pool.take(8000)  # both free and smaller: dropped, not kept beside the new one
    assert pool.held_bytes == 8000


def test_threads_taking_at_once_get_distinct_memory():
    pool = ReceiveBuffers()
    taken, barrier = [], threading.Barrier(8)

    def take():
        barrier.wait()
        taken.append(pool.take(4096))

    threads = [threading.Thread(target=take) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len({address(a) for a in taken}) == 8


def tiny_model(seed: int) -> transformers.PreTrainedModel:
    config = transformers.Qwen2Config(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True)
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(config).eval()


def received(pool: ReceiveBuffers, model, version: int, bucket_bytes: int) -> list[Bucket]:
    """`model`'s weights as the collective's receiving side hands them to a stager: each bucket's bytes
    copied into a buffer of the pool (what gloo's receive does), split into its tensors' arrays."""
    out = []
    for bucket in pack_buckets(model.state_dict().items(), bucket_bytes, version):
        flat = pool.take(bucket.nbytes)
        cursor, arrays = 0, []
        for s, array in zip(bucket.slices, bucket.data):
            flat[cursor:cursor + s.nbytes] = np.frombuffer(np.ascontiguousarray(array), dtype=np.uint8)
            arrays.append(flat[cursor:cursor + s.nbytes])
            cursor += s.nbytes
        out.append(Bucket(version, bucket.index, arrays, bucket.slices))
    return out


@pytest.mark.parametrize("bucket_bytes", [2048, 1 << 20])
def test_swapped_in_weights_are_never_received_into_and_a_retired_version_is(bucket_bytes):
    """Dual buffer: versions 1, 2, 3 received through the pool and swapped in one after the other. While
    version 2 serves, version 3 goes into version 1's memory (retired when 2 was swapped in), never into
    version 2's, and every version serves its own bytes."""
    serving = tiny_model(0)
    expected, aliases, params = weight_layout(serving.state_dict(keep_vars=True))
    stager, pool = VersionStager(expected, aliases), ReceiveBuffers()
    trained = {version: tiny_model(version) for version in (1, 2, 3)}
    memory, sent = {}, {}
    for version, model in trained.items():
        buckets = received(pool, model, version, bucket_bytes)
        memory[version] = {address(a) for b in buckets for a in b.data}
        sent[version] = sum(b.nbytes for b in buckets)
        for bucket in buckets:
            stager.stage(version, bucket)
        stager.check_complete(version, len(buckets))
        del buckets
        stager.swap_into(params)
        assert {n: digest(t) for n, t in serving.state_dict().items()} == {
            n: digest(t) for n, t in model.state_dict().items()}, version
    assert memory[3] == memory[1]  # received into the retired version's memory
    assert not memory[3] & memory[2]  # never into the serving one's
    assert pool.held_bytes == sent[1] + sent[2]  # two versions' memory, no more
