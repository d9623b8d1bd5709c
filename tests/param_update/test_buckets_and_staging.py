"""The weight sync's parts without Ray: buckets, staging (dual / single buffer), the engine's load.

The Ray-level sync (object store, receivers as actors, failures) is in test_sync_*.py.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
import transformers

from async_rl.api.weights import Bucket
from async_rl.core.config import MB
from async_rl.core.errors import BucketSizeError
from async_rl.rollout.cpu.engine import ContinuousBatchingEngine
from param_update.buckets import check_bucket_sizes, pack_buckets, tensors_from_buckets
from param_update.buckets import tensor_digest as digest
from param_update.capacity import check_weight_sync, model_weight_bytes
from param_update.staging import StagingError, VersionStager, canonical_names, weight_layout
from param_update.transports.object_store import join_arrays, split_arrays


def tiny_model(seed: int) -> transformers.PreTrainedModel:
    config = transformers.Qwen2Config(
        vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(config).eval()


def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(7, 5, generator=g)),
        ("empty", torch.zeros(0, 3)),
        ("half", torch.randn(33, generator=g).to(torch.bfloat16)),
        ("ints", torch.arange(10, dtype=torch.int64)),
        ("big", torch.randn(64, 64, generator=g)),  # 16 KiB
        ("scalar", torch.tensor(3.5)),
    ]


# ---- buckets --------------------------------------------------------------------------------


@pytest.mark.parametrize("bucket_bytes", [3, 100, 140, 4096, 64 * 64 * 4, 1 << 20])
def test_buckets_round_trip_bit_identical(bucket_bytes):
    """Bucket smaller than, equal to and larger than single tensors (140 = tensor 'a')."""
    named = mixed_tensors()
    buckets = list(pack_buckets(iter(named), bucket_bytes, version=3))
    assert all(b.version == 3 and b.nbytes <= bucket_bytes for b in buckets)
    assert all(len(b.data) == len(b.slices) for b in buckets)
    assert [b.index for b in buckets] == list(range(len(buckets)))
    total = sum(t.nbytes for _, t in named)
    assert sum(b.nbytes for b in buckets) == total
    for name, tensor in named:  # only tensors larger than a bucket are split
        pieces = sum(1 for b in buckets for s in b.slices if s.name == name)
        if tensor.nbytes <= bucket_bytes:
            assert pieces == 1, name
        else:  # it may start in a partly filled bucket
            assert -(-tensor.nbytes // bucket_bytes) <= pieces <= -(-tensor.nbytes // bucket_bytes) + 1, name
    rebuilt = list(tensors_from_buckets(buckets))
    assert [n for n, _ in rebuilt] == [n for n, _ in named]
    for (_, original), (_, copy) in zip(named, rebuilt):
        assert digest(original) == digest(copy)
    # packing copies nothing: a whole tensor comes back as a view of the sender's own memory
    whole = [(n, t) for (n, t), (_, r) in zip(named, rebuilt) if t.numel() and r.data_ptr() == t.data_ptr()]
    assert whole or bucket_bytes < 140

@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7, 20])
def test_a_bucket_splits_into_runs_of_about_equal_bytes_in_order(parts):
    import numpy as np

    sizes = [5, 1, 1, 8, 3, 3, 3, 0, 2, 9, 4]
    data = [np.full(n, i, dtype=np.uint8) for i, n in enumerate(sizes)]
    runs = split_arrays(data, parts)
    assert 1 <= len(runs) <= parts
    assert all(runs), "no run is empty"
    joined = join_arrays(runs)
    assert [id(a) for a in joined] == [id(a) for a in data]  # same arrays, same order, no copy
    # a run exceeds the fair share by less than one array
    assert max(sum(a.nbytes for a in run) for run in runs) < sum(sizes) / parts + max(sizes)
    if parts <= len(sizes) // 2:
        assert len(runs) == parts


def test_missing_bucket_leaves_a_tensor_incomplete():
    buckets = list(pack_buckets(iter(mixed_tensors()), 1000, version=0))
    with pytest.raises(ValueError, match="incomplete tensors"):
        list(tensors_from_buckets(buckets[:-1]))


def test_bucket_sizes_that_cannot_work_fail_at_start():
    sizes = check_bucket_sizes(100 * MB, preduce_mb=512, consume_mb=1)
    assert sizes == {"preduce": 512 * MB, "consume": MB}
    with pytest.raises(BucketSizeError, match="param_update_consume_bucket_size_mb=1e-05 splits the 100.0 MB model"):
        check_bucket_sizes(100 * MB, preduce_mb=1, consume_mb=1e-5)
    with pytest.raises(BucketSizeError, match="under one byte"):
        check_bucket_sizes(MB, preduce_mb=1e-9, consume_mb=1)


def test_object_store_must_hold_the_staged_versions():
    """Dual buffer: serving + arriving version in the object store; single: one version."""
    store = {"store"}
    check_weight_sync(400 * MB, 64, 64, 2, store, {"store": 1000 * MB})  # 2 x 400 + 2 x 64
    with pytest.raises(BucketSizeError) as info:
        check_weight_sync(400 * MB, 128, 64, 2, store, {"store": 1000 * MB})  # 2 x 400 + 2 x 128
    message = str(info.value)
    assert "preduce_bucket_size_mb=128: 2 versions of the 400 MB model and two buckets in flight need 1056 MB" in message
    assert "enable_dual_buffer=False" in message
    check_weight_sync(400 * MB, 128, 64, 1, store, {"store": 1000 * MB})


def test_the_links_follow_the_placement_and_each_link_checks_its_own_room():
    """One node: every receiver maps the trainer's shared memory, the object store holds no version; generate
    on the second node: its servers get the versions in the collective group; verl's GPU replicas, whose
    nodes are unknown, through the store."""
    from omegaconf import OmegaConf

    from async_rl.core.config import read_async_config
    from async_rl.core.placement import plan_placement
    from param_update.capacity import planned_links

    def placement(nodes, values):
        ratios = read_async_config(OmegaConf.create({"trainer": {"use_nodes_ratios": values}})).ratios_by_role
        return plan_placement(nodes, 2, ratios, ["train", "logp"], replica_devices=1)

    one_node, two_nodes = placement(1, [0.5, 0.5, 0.5, 0.5]), placement(2, [0.5, 0.5, 0.5, 0.5])
    assert planned_links(one_node, replicas_read_same_node=True, logp_receives=True) == {"shm"}
    assert planned_links(two_nodes, replicas_read_same_node=True, logp_receives=True) == {"shm", "collective"}
    assert planned_links(two_nodes, replicas_read_same_node=True, logp_receives=False) == {"collective"}
    assert planned_links(one_node, replicas_read_same_node=False, logp_receives=False) == {"store"}

    # shared memory only: an object store too small for two versions does not matter, a small /dev/shm does
    check_weight_sync(400 * MB, 128, 64, 2, {"shm"}, {"store": 100 * MB, "shm": 801 * MB})
    with pytest.raises(BucketSizeError, match=r"needs 2 x 400 MB .* which has 799 MB free: give it more room"):
        check_weight_sync(400 * MB, 128, 64, 2, {"shm"}, {"store": 10_000 * MB, "shm": 799 * MB})
    with pytest.raises(BucketSizeError, match="2 versions of the 400 MB model"):
        check_weight_sync(400 * MB, 128, 64, 2, {"shm", "store"}, {"store": 100 * MB, "shm": 10_000 * MB})


def test_model_weight_bytes_counts_tied_weights_once(tmp_path):
    model = tiny_model(0)
    model.save_pretrained(tmp_path)
    params = sum(p.numel() for p in model.parameters())  # parameters() skips the tied lm_head
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert model_weight_bytes(str(tmp_path)) == params * 4 + buffers


# ---- staging ----------------------------------------------------------------------------------


def layout(model):
    return weight_layout(model.state_dict(keep_vars=True))


def test_tied_weights_have_one_canonical_name():
    state = tiny_model(0).state_dict(keep_vars=True)
    names = canonical_names(state)
    assert names["lm_head.weight"] == "model.embed_tokens.weight"
    assert sum(1 for n, c in names.items() if n != c) == 1


@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("bucket_bytes", [512, 32 * 16 * 4, 1 << 20])  # < tensor, = embedding, > model
def test_staged_version_loads_bit_identical(swap, bucket_bytes):
    serving, trained = tiny_model(0), tiny_model(1)
    expected, aliases, tensors = layout(serving)
    stager = VersionStager(expected, aliases)
    buckets = list(pack_buckets(trained.state_dict().items(), bucket_bytes, version=1))
    for bucket in reversed(buckets):  # arrival order does not matter
        stager.stage(1, bucket)
    stager.check_complete(1, len(buckets))
    if swap:
        stager.swap_into(tensors)
    else:
        stager.copy_into(tensors, consume_bytes=1000)
    assert {n: digest(t) for n, t in serving.state_dict().items()} == {
        n: digest(t) for n, t in trained.state_dict().items()
    }
    assert serving.lm_head.weight is serving.model.embed_tokens.weight  # still tied
    assert stager.version is None  # ready for the next version
    if swap and bucket_bytes == 1 << 20:  # zero copy: the weights are the staged memory itself
        assert serving.model.norm.weight.data_ptr() == trained.model.norm.weight.data_ptr()


@pytest.mark.parametrize("swap", [True, False])
def test_a_device_staging_buffer_holds_its_own_copy_of_each_bucket(swap):
    """`device` puts the register-buffer in that device's memory (a GPU's; here "cpu", the same code):
    each bucket is copied there as it is staged, so what the transport handed out can be reused at once,
    and the load still gives the version's bytes."""
    serving, trained = tiny_model(0), tiny_model(1)
    expected, aliases, tensors = layout(serving)
    stager = VersionStager(expected, aliases, device="cpu")
    buckets = [Bucket(1, b.index, [a.copy() for a in b.data], b.slices)  # as a transport hands them out
               for b in pack_buckets(trained.state_dict().items(), 512, version=1)]
    for bucket in buckets:
        stager.stage(1, bucket)
    for bucket in buckets:  # the transport's memory reused
        for array in bucket.data:
            array[:] = 0
    stager.check_complete(1, len(buckets))
    if swap:
        stager.swap_into(tensors)
    else:
        stager.copy_into(tensors, consume_bytes=1000)
    assert {n: digest(t) for n, t in serving.state_dict().items()} == {
        n: digest(t) for n, t in trained.state_dict().items()
    }


def test_incomplete_version_is_refused_and_serving_untouched():
    serving, trained = tiny_model(0), tiny_model(1)
    expected, aliases, tensors = layout(serving)
    stager = VersionStager(expected, aliases)
    buckets = list(pack_buckets(trained.state_dict().items(), 2048, version=4))
    before = {n: digest(t) for n, t in serving.state_dict().items()}
    for bucket in buckets[:-2]:
        stager.stage(4, bucket)
    with pytest.raises(StagingError, match=rf"version 4: buckets \[{len(buckets) - 2}, {len(buckets) - 1}\]"):
        stager.check_complete(4, len(buckets))
    with pytest.raises(StagingError, match="version 5 was never staged"):
        stager.check_complete(5, len(buckets))
    stager.reset()
    assert {n: digest(t) for n, t in serving.state_dict().items()} == before


def test_staging_rejects_what_does_not_belong():
    serving = tiny_model(0)
    expected, aliases, _ = layout(serving)
    stager = VersionStager(expected, aliases)
    good = list(pack_buckets(tiny_model(1).state_dict().items(), 1 << 20, version=2))
    stager.stage(2, good[0])
    with pytest.raises(StagingError, match="bucket 0 arrived twice"):
        stager.stage(2, good[0])
    with pytest.raises(StagingError, match="bucket of version 3 arrived while staging version 2"):
        stager.stage(3, list(pack_buckets(tiny_model(1).state_dict().items(), 1 << 20, version=3))[0])
    stager.reset()
    with pytest.raises(StagingError, match="unknown tensor 'model.bogus'"):
        stager.stage(2, next(pack_buckets([("model.bogus", torch.zeros(2))], 64, version=2)))
    stager.reset()
    wrong = [("model.norm.weight", torch.zeros(3))]
    with pytest.raises(StagingError, match=r"'model.norm.weight' is torch.float32 \(3,\), expected torch.float32 \(32,\)"):
        stager.stage(2, next(pack_buckets(wrong, 64, version=2)))
    # names that arrived but not all bytes: a tensor missing from the version
    stager.reset()
    partial = [(n, t) for n, t in tiny_model(1).state_dict().items() if n != "model.norm.weight"]
    for bucket in pack_buckets(partial, 1 << 20, version=2):
        stager.stage(2, bucket)
    with pytest.raises(StagingError, match=r"tensors \['model.norm.weight'\] incomplete"):
        stager.check_complete(2, 1)


# ---- the engine's load ------------------------------------------------------------------------


def teacher_forced_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logps = torch.log_softmax(logits, dim=-1)
    return [float(logps[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


@pytest.mark.parametrize("dual", [True, False])
def test_engine_loads_between_steps_and_no_token_sees_two_versions(dual):
    """Requests run through a sync: each token's log-prob is exactly what its recorded version gives."""
    models = {0: tiny_model(0), 1: tiny_model(1)}
    engine = ContinuousBatchingEngine(tiny_model(0), eos_token_ids=[], seed=0)
    expected, aliases, _ = engine.weight_layout()
    stager = VersionStager(expected, aliases)
    buckets = list(pack_buckets(models[1].state_dict().items(), 4096, version=1))
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]

    async def until_more_tokens(than: int):
        while engine.num_generated_tokens <= than:
            await asyncio.sleep(0.001)

    async def main():
        jobs = [
            asyncio.ensure_future(engine.generate(p, {"temperature": 1.0, "max_new_tokens": 50}, f"r{i}"))
            for i, p in enumerate(prompts)
        ]
        await until_more_tokens(3)  # decoding under version 0
        for i, bucket in enumerate(buckets):
            await asyncio.to_thread(stager.stage, 1, bucket)
            if i < 5:  # decoding goes on between registered buckets (a hang here fails the test)
                await until_more_tokens(engine.num_generated_tokens)
        stager.check_complete(1, len(buckets))
        blocked = await engine.load_staged(stager, version=1, consume_bytes=4096, swap=dual)
        return await asyncio.gather(*jobs), blocked

    results, blocked = asyncio.run(asyncio.wait_for(main(), 60))
    assert blocked >= 0 and engine.param_version == 1
    versions = [v for r in results for v in r.token_versions]
    assert 0 in versions and 1 in versions
    assert engine.last_load_interrupted == sum({0, 1} <= set(r.token_versions) for r in results) > 0
    for prompt, result in zip(prompts, results):
        assert result.token_versions == sorted(result.token_versions)  # versions never go back
        for i, version in enumerate(result.token_versions):
            want = teacher_forced_logprobs(models[version], prompt, result.token_ids[: i + 1])[-1]
            assert abs(result.log_probs[i] - want) < 1e-4, (i, version)
    assert {n: digest(t) for n, t in engine.model.state_dict().items()} == {
        n: digest(t) for n, t in models[1].state_dict().items()
    }


def test_load_without_partial_rollout_waits_for_running_requests():
    """partial_rollout=False: running requests finish under the old version, queued ones start under the new."""
    engine = ContinuousBatchingEngine(tiny_model(0), eos_token_ids=[], seed=0, max_num_seqs=4)
    expected, aliases, _ = engine.weight_layout()
    stager = VersionStager(expected, aliases)
    buckets = list(pack_buckets(tiny_model(1).state_dict().items(), 1 << 20, version=1))

    async def main():
        running = [asyncio.ensure_future(engine.generate([1, 2, 3], {"temperature": 1.0, "max_new_tokens": 30},
                                                         f"r{i}")) for i in range(2)]
        while engine.num_generated_tokens < 2:
            await asyncio.sleep(0.001)
        queued = asyncio.ensure_future(engine.generate([4, 5], {"temperature": 1.0, "max_new_tokens": 5}, "q"))
        for bucket in buckets:
            stager.stage(1, bucket)
        blocked = await engine.load_staged(stager, version=1, consume_bytes=4096, swap=True, interrupt=False)
        assert all(job.done() for job in running)  # the load waited for them
        return await asyncio.gather(*running), await queued, blocked

    running, queued, blocked = asyncio.run(asyncio.wait_for(main(), 60))
    for result in running:
        assert len(result.token_ids) == 30 and set(result.token_versions) == {0}
    assert set(queued.token_versions) == {1}  # admitted only after the load
    assert blocked > 0 and engine.last_load_interrupted == 0
