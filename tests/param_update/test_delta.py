"""Delta sync (param_update/delta.py): a version sent as the values changed since the one before, as
receivers hold them, gives the bytes a full sync gives.

Without Ray: a float32 model's versions, held in bf16, through the encoder, buckets and a staging
buffer, loaded by swap and by copy, each bit-identical to the version cast whole; a delta over a base
the receiver does not hold is refused at its check. Through Ray: the param_update stage with the
table's delta option syncs a CPU rollout server bit-identical version after version, and a server
restarted in its place loads the whole version kept for restarts, then takes deltas again."""

from __future__ import annotations

import pytest
import ray
import torch
from omegaconf import OmegaConf

from async_rl.api.weights import Bucket, ReceiverSetup, TransportTable
from param_update.buckets import pack_buckets, tensor_digest
from param_update.delta import (BASE, GAP_LIMIT, INDEX, VALUE, DeltaEncoder, DeltaVersion, as_held, positions_of,
                                positions_on_device)
from param_update.staging import StagingError, VersionStager, weight_layout
from sync_actors import TIMEOUT_S, Trainer, served, start_server, start_stage, sync, tiny_model


def held_digests(state: dict, dtype) -> dict:
    return {name: tensor_digest(as_held(t, dtype)) for name, t in state.items()}


def stage_version(stager: VersionStager, wire, version: int, bucket_bytes: int = 700) -> int:
    """Stage and check `wire`'s buckets as a receiver does; returns the bytes sent."""
    buckets = list(pack_buckets(wire, bucket_bytes, version))
    for b in buckets:
        stager.stage(version, Bucket(version, b.index, [a.copy() for a in b.data], b.slices))
    stager.check_complete(version, len(buckets))
    return sum(b.nbytes for b in buckets)


def nudge(model, fraction: float, seed: int) -> None:
    """An update that moves `fraction` of every tensor's values (the rest keep their bits in bf16)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            moved = torch.rand(p.shape, generator=g) < fraction
            p.add_(moved * 0.05 * p.abs().clamp_min(1e-3))


@pytest.mark.parametrize("swap", [True, False])
def test_deltas_held_in_bf16_give_the_bytes_of_the_whole_version(swap):
    model = tiny_model(1)
    held = {name: torch.bfloat16 for name in model.state_dict()}
    expected, aliases, _ = weight_layout({n: t.to(torch.bfloat16) for n, t in model.state_dict().items()})
    params = {name: torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
              for name, (dtype, shape) in expected.items()}
    stager, encoder = VersionStager(expected, aliases), DeltaEncoder(held)
    sent = []
    for version in range(1, 5):
        if version > 1:
            nudge(model, 0.02, version)
        wire = list(encoder.encode(model.state_dict().items(), version, encoder.version))
        assert (wire[0][0] == BASE) == (version > 1)
        sent.append(stage_version(stager, wire, version))
        if swap:
            stager.swap_into(params)
        else:
            stager.copy_into(params, consume_bytes=512)
        want = held_digests(model.state_dict(), torch.bfloat16)
        assert {name: tensor_digest(p.data) for name, p in params.items()} == {n: want[n] for n in params}
        assert stager.base_version == version
    assert max(sent[1:]) < 0.25 * sent[0]  # 2 % of the values moved: a delta is a fraction of the whole


@pytest.mark.parametrize("changed", [[0, 70_000, 200_000, 299_999], [65_535], [65_536], [131_071, 131_072, 299_000],
                                     [], list(range(0, 300_000, 40_000))])
def test_changes_far_apart_go_as_16_bit_gaps_with_unchanged_values_bridging_them(changed):
    """A bf16 tensor of 300,000 values, a few changed far apart: the delta's positions are 16-bit gaps,
    unchanged values bridging any gap over GAP_LIMIT, and the receiver puts together the new tensor."""
    g = torch.Generator().manual_seed(0)
    old = torch.randn(300_000, generator=g).to(torch.bfloat16)
    new = old.clone()
    new[changed] = (new[changed].float() + 1).to(torch.bfloat16)
    encoder = DeltaEncoder()
    list(encoder.encode([("w", old)], 1, None))
    wire = dict(encoder.encode([("w", new)], 2, 1))
    gaps, values = wire["w" + INDEX], wire["w" + VALUE]
    assert gaps.dtype == torch.int16 and values.dtype == torch.bfloat16
    positions = positions_of(gaps)
    assert torch.equal(positions_on_device(gaps), positions)  # torch's running sum, as a GPU's staged delta takes it
    assert set(changed) <= set(positions.tolist())
    assert int((torch.diff(positions, prepend=positions.new_zeros(1)) > GAP_LIMIT).sum()) == 0
    bridged = [p for p in positions.tolist() if p not in set(changed)]
    assert len(bridged) <= 300_000 // GAP_LIMIT + len(changed)  # a few, only where a gap needs them
    assert torch.equal(new[bridged].view(torch.int16), old[bridged].view(torch.int16))  # unchanged values
    assert 2 * gaps.numel() + values.nbytes < new.nbytes
    out = DeltaVersion(wire, {"w": old}, 1).tensor("w")
    assert torch.equal(out.view(torch.int16), new.view(torch.int16))


def test_positions_on_device_read_gaps_of_32768_and_more_as_uint16():
    gaps = torch.tensor([3, 65_535, 40_000, 32_768, 1], dtype=torch.int32).to(torch.int16)  # the wire's int16 bits
    want = [3, 65_538, 105_538, 138_306, 138_307]
    assert positions_of(gaps).tolist() == want and positions_on_device(gaps).tolist() == want


def test_a_delta_over_a_base_the_receiver_does_not_hold_is_refused_at_its_check():
    model = tiny_model(1)
    expected, aliases, _ = weight_layout(model.state_dict())
    encoder = DeltaEncoder()
    list(encoder.encode(model.state_dict().items(), 1, None))
    nudge(model, 0.02, 2)
    restarted = VersionStager(expected, aliases)  # a new receiver: it holds nothing a delta applies to
    with pytest.raises(StagingError, match="version 2: a delta from version 1 arrived, the receiver holds version None"):
        stage_version(restarted, encoder.encode(model.state_dict().items(), 2, 1), 2)
    with pytest.raises(ValueError, match="a delta from version 1 asked, the sender keeps version 2"):
        list(encoder.encode(model.state_dict().items(), 3, 1))


def test_delta_sync_is_refused_at_start_where_a_receiver_keeps_no_base(demo_dir):
    """The logp ranks load into FSDP shards and a LoRA version is an adapter: neither keeps the full
    weights a delta applies to, so the key is refused at start, naming why."""
    from async_rl.core.errors import AsyncConfigError
    from async_rl.demo import demo_overrides
    from async_rl.run_config import read_run_config
    from helpers.lineage import compose_ppo

    key = "+actor_rollout_ref.rollout.param_update_delta_sync"
    read_run_config(compose_ppo(demo_overrides(demo_dir, extra={key: True})))  # the demo: CPU servers
    for extra, why in (({"+algorithm.proximal_logp_workers": "logp"}, "proximal_logp_workers=logp"),
                       ({"actor_rollout_ref.model.lora_rank": 8}, "lora_rank > 0")):
        with pytest.raises(AsyncConfigError, match=f"param_update_delta_sync=True.*False with .*{why}"):
            read_run_config(compose_ppo(demo_overrides(demo_dir, extra={key: True, **extra})))


def test_delta_sync_is_refused_at_start_with_a_backend_it_has_not_run_through():
    """Deltas into SGLang's and TRT-LLM's replicas have never run end to end (vLLM's: tests/e2e/test_vllm_cpu_e2e.py),
    so the key is refused there, naming the backend (checked without their packages, which this venv lacks)."""
    import async_rl.rollout.backends as backends
    from async_rl.core.config import AsyncPipelineConfig
    from async_rl.core.errors import AsyncConfigError
    from async_rl.run_config import _check_delta_sync

    config = OmegaConf.create({"actor_rollout_ref": {"model": {"lora_rank": 0}}})
    deltas = AsyncPipelineConfig(delta_sync=True)
    for backend in (backends.CPU, backends.VLLM):
        _check_delta_sync(config, deltas, backend)
    for backend in (backends.SGLANG, backends.TRTLLM):
        with pytest.raises(AsyncConfigError, match=f"False with rollout.name={backend.name} .*untested"):
            _check_delta_sync(config, deltas, backend)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("delta_model")
    tiny_model(0).save_pretrained(path)
    return str(path)


def test_the_stage_syncs_deltas_bit_identical_and_a_restart_loads_the_whole_kept_version(small_objects_ray,
                                                                                         model_dir):
    server = start_server(model_dir, True)
    stage = start_stage([server], restartable=True, transports=TransportTable(delta=True))
    ray.get(stage.configure_rollout_servers.remote(ReceiverSetup(True, 4096)), timeout=TIMEOUT_S)
    trainer = Trainer.remote(seed=1)
    full = sync(stage, trainer, 1)
    assert full["async/param_update/delta"] == 0.0  # nothing to diff against yet
    for version in (2, 3):
        ray.get(trainer.nudge.remote(0.02, version), timeout=TIMEOUT_S)
        timings = sync(stage, trainer, version)
        assert timings["async/param_update/delta"] == 1.0
        assert timings["async/param_update/bytes"] < 0.25 * full["async/param_update/bytes"]
        assert served(server) == (version, ray.get(trainer.digests.remote(), timeout=TIMEOUT_S))
    restarted = start_server(model_dir, True, configure=False)
    assert ray.get(stage.replace_rollout_server.remote(0, restarted), timeout=TIMEOUT_S) == 3
    assert served(restarted) == (3, ray.get(trainer.digests.remote(), timeout=TIMEOUT_S))
    ray.get(trainer.nudge.remote(0.02, 4), timeout=TIMEOUT_S)
    assert sync(stage, trainer, 4)["async/param_update/delta"] == 1.0
    assert served(restarted) == (4, ray.get(trainer.digests.remote(), timeout=TIMEOUT_S))
    ray.get(trainer.close.remote(), timeout=TIMEOUT_S)


def test_deltas_into_verls_replicas_hold_their_base_as_a_second_version():
    """verl's replicas keep the version they loaded staged (views of what arrived) as a delta's base, so the
    start-time room check counts two versions for them; the CPU servers' base is their own weights."""
    import async_rl.rollout.backends  # noqa: F401 - registers the backends
    from async_rl.api.rollout import rollout_backend
    from async_rl.build import versions_held
    from async_rl.core.config import AsyncPipelineConfig

    single = AsyncPipelineConfig(enable_dual_buffer=False, replica_max_restarts=0)
    deltas = AsyncPipelineConfig(enable_dual_buffer=False, replica_max_restarts=0, delta_sync=True)
    vllm, cpu = rollout_backend("vllm"), rollout_backend("cpu")
    assert [versions_held(single, vllm), versions_held(deltas, vllm), versions_held(deltas, cpu)] == [1, 2, 1]
    assert versions_held(AsyncPipelineConfig(enable_dual_buffer=True, replica_max_restarts=0), cpu) == 2
