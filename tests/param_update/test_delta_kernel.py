"""The delta's C loops (param_update/delta_kernel.py) against its numpy path (param_update/delta.py): the same
wire, bit for bit, at every compare loop this CPU runs; the numpy path where the kernel cannot be built; and
a delta put together in the memory the dual buffer swapped out, never in the memory that serves. No Ray."""

from __future__ import annotations

import pytest
import torch

from async_rl.api.weights import Bucket
from param_update import delta_kernel
from param_update.buckets import pack_buckets, tensor_digest
from param_update.delta import GAP_LIMIT, DeltaEncoder, as_held, changed_positions, changes, wire_positions
from param_update.staging import StagingError, VersionStager, weight_layout

NATIVE = delta_kernel.kernel()
LEVELS = [name for name, value in delta_kernel.LEVELS.items()  # the compare loops this CPU runs
          if name != "best" and NATIVE is not None and value <= delta_kernel.LEVELS[NATIVE.level]]


def numpy_wire(new: torch.Tensor, old: torch.Tensor):
    positions, gaps = wire_positions(changed_positions(new, old))
    return gaps, new.reshape(-1)[positions]


def changed_copy(old: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    new = old.clone()
    moved = torch.rand(old.shape, generator=g) < fraction
    new[moved] = torch.randn(int(moved.sum()), generator=g).to(old.dtype)
    return new


CASES = [  # (values, fraction changed): lengths off the 8/16/32-element blocks, gaps past GAP_LIMIT
    (0, 0.5), (1, 1.0), (31, 0.5), (33, 0.3), (1000, 0.0), (1000, 1.0), (4099, 0.04), (300_007, 2e-5),
    (3 * GAP_LIMIT + 5, 0.0),
]


def test_the_machine_builds_the_kernel():
    """CI's machines have a C compiler: the kernel is what runs there (the tests below need it), the numpy path
    the fallback."""
    assert NATIVE is not None
    assert NATIVE.level in delta_kernel.LEVELS


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,fraction", CASES)
def test_encode_gives_the_numpy_wire(level, dtype, n, fraction):
    old = torch.randn(n).to(dtype)
    new = changed_copy(old, fraction, seed=n)
    if n > 2:
        new[-1] = new[-1] + 1  # a change in the last, partial block
        old[1], new[1] = 0.0, -0.0  # equal as numbers, not bit for bit: a change
    want_gaps, want_values = numpy_wire(new, old)
    got = NATIVE.encode(new, old, cap=n + n // GAP_LIMIT + 1, level=level)
    assert got is not None
    assert torch.equal(got[0], want_gaps)
    assert torch.equal(got[1].view(torch.uint8), want_values.view(torch.uint8))
    if want_gaps.numel():  # one position fewer than it needs: no delta
        assert NATIVE.encode(new, old, cap=want_gaps.numel() - 1, level=level) is None


@pytest.mark.parametrize("level", LEVELS)
def test_encode_bridges_long_gaps_and_counts_the_bridges_against_the_cap(level):
    old = torch.zeros(5 * GAP_LIMIT, dtype=torch.bfloat16)
    new = old.clone()
    new[[0, 4 * GAP_LIMIT + 7]] = 1.0  # a gap of 4 * GAP_LIMIT + 7: four bridge positions inside it
    gaps, values = NATIVE.encode(new, old, cap=6, level=level)
    assert gaps.view(torch.uint16).tolist() == [0, GAP_LIMIT, GAP_LIMIT, GAP_LIMIT, GAP_LIMIT, 7]
    assert values.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert NATIVE.encode(new, old, cap=5, level=level) is None
    new = old.clone()
    new[[0, GAP_LIMIT, 2 * GAP_LIMIT + 1]] = 1.0  # gaps of GAP_LIMIT (sent as it is) and GAP_LIMIT + 1 (bridged)
    gaps, values = NATIVE.encode(new, old, cap=10, level=level)
    assert gaps.view(torch.uint16).tolist() == [0, GAP_LIMIT, GAP_LIMIT, 1]
    assert torch.equal(gaps, numpy_wire(new, old)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_puts_the_new_version_together_and_refuses_positions_past_the_end(dtype):
    old = torch.randn(70_001).to(dtype)
    new = changed_copy(old, 0.03, seed=1)
    new[-1] = new[-1] + 1
    gaps, values = NATIVE.encode(new, old, cap=old.numel())
    out = old.clone()
    NATIVE.write(out, gaps, values)
    assert tensor_digest(out) == tensor_digest(new)
    with pytest.raises(ValueError, match="past the end"):
        NATIVE.write(old[:-1].clone(), gaps, values)  # the last change lies on the missing value
    with pytest.raises(ValueError, match="one dtype and shape"):
        NATIVE.encode(new, old[:-1], cap=old.numel())
    with pytest.raises(ValueError, match="gaps"):
        NATIVE.write(old.clone(), gaps, values.to(torch.float16 if dtype != torch.float16 else torch.float32))


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "numpy"])
def test_a_tensor_is_sent_whole_when_its_delta_is_no_smaller(native, monkeypatch):
    if not native:
        monkeypatch.setattr(delta_kernel, "kernel", lambda: None)
    old = torch.randn(1000).to(torch.bfloat16)
    new = old.clone()
    new[:249] += 1  # 249 changes: 996 bytes of delta against 2,000 whole
    assert changes(new, old) is not None
    new[:500] += 1  # 500 changes: 2,000 bytes, no smaller
    assert changes(new, old) is None
    assert changes(new[:0], old[:0]) is None  # an empty tensor: whole (no bytes either way)


def test_the_kernel_builds_into_an_empty_folder_once(tmp_path):
    import ctypes

    built = delta_kernel.build(tmp_path)
    assert built.parent == tmp_path and built.name.startswith("delta_kernel-") and built.suffix == ".so"
    assert delta_kernel.DeltaKernel(ctypes.CDLL(str(built))).level == NATIVE.level
    mtime = built.stat().st_mtime_ns
    assert delta_kernel.build(tmp_path) == built and built.stat().st_mtime_ns == mtime  # found, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [built.name]  # nothing left from the build


def test_an_unbuildable_kernel_leaves_the_numpy_path(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    with pytest.raises(Exception, match="false exited"):
        delta_kernel.build(tmp_path)
    assert not list(tmp_path.iterdir())  # no partial library left to load
    monkeypatch.setattr(delta_kernel, "_loaded", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert delta_kernel.kernel() is None
    old = torch.randn(5000).to(torch.bfloat16)
    new = changed_copy(old, 0.05, seed=2)
    gaps, values = changes(new, old)
    assert torch.equal(gaps, numpy_wire(new, old)[0])
    assert changes(new, changed_copy(new, 1.0, seed=3)) is None  # every value changed: sent whole


def model_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(64, 48, generator=g), "layer.weight": torch.randn(48, 48, generator=g),
            "norm": torch.ones(48)}


def nudged(state: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {name: t + (torch.rand(t.shape, generator=g) < 0.05) * 0.1 for name, t in state.items()}


def stage(stager: VersionStager, wire: list, version: int) -> None:
    buckets = list(pack_buckets(wire, 4096, version))
    for b in buckets:
        stager.stage(version, Bucket(version, b.index, [a.copy() for a in b.data], b.slices))
    stager.check_complete(version, len(buckets))


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "numpy"])
def test_the_dual_buffer_puts_a_delta_together_in_the_memory_it_swapped_out(native, monkeypatch):
    if not native:
        monkeypatch.setattr(delta_kernel, "kernel", lambda: None)
    held = dict.fromkeys(model_state(0), torch.bfloat16)
    expected, aliases, _ = weight_layout({n: t.to(torch.bfloat16) for n, t in model_state(0).items()})
    params = {name: torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
              for name, (dtype, shape) in expected.items()}
    stager, encoder, state = VersionStager(expected, aliases), DeltaEncoder(held), model_state(0)
    served = []  # per version: name -> (data_ptr, digest) of what served
    for version in range(1, 6):
        if version > 1:
            state = nudged(state, version)
        stage(stager, list(encoder.encode(state.items(), version, encoder.version)), version)
        if served:  # the check put the next version together: what serves is untouched
            assert {n: (p.data_ptr(), tensor_digest(p.data)) for n, p in params.items()} == served[-1]
        stager.swap_into(params)
        assert {n: tensor_digest(p.data) for n, p in params.items()} == \
            {n: tensor_digest(t.to(torch.bfloat16)) for n, t in state.items()}
        served.append({n: (p.data_ptr(), tensor_digest(p.data)) for n, p in params.items()})
    # versions 2 and 3 were put together in new memory; from version 4 on, in what served two versions before
    for name in params:
        assert served[3][name][0] == served[1][name][0] and served[4][name][0] == served[2][name][0]
        assert served[2][name][0] != served[1][name][0]


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "numpy"])
def test_a_delta_past_a_tensors_end_is_refused_at_the_check(native, monkeypatch):
    if not native:
        monkeypatch.setattr(delta_kernel, "kernel", lambda: None)
    state = model_state(0)
    held = dict.fromkeys(state, torch.bfloat16)
    expected, aliases, _ = weight_layout({n: t.to(torch.bfloat16) for n, t in state.items()})
    params = {name: torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
              for name, (dtype, shape) in expected.items()}
    stager, encoder = VersionStager(expected, aliases), DeltaEncoder(held)
    stage(stager, list(encoder.encode(state.items(), 1, None)), 1)
    stager.swap_into(params)
    wire = list(encoder.encode(nudged(state, 2).items(), 2, 1))
    wire = [(name, t.clone()) for name, t in wire]
    index = next(t for name, t in wire if name.startswith("layer.weight") and t.dtype == torch.int16)
    index[-1] = -1  # a last gap of 65535: past the 2,304 values of layer.weight
    with pytest.raises(StagingError, match="version 2: .*past the end"):
        stage(stager, wire, 2)


@pytest.mark.parametrize("reuse", [True, False])
def test_the_encoder_casts_into_the_version_two_back_only_when_told_it_is_copied_out(reuse):
    state = model_state(0)
    encoder = DeltaEncoder(dict.fromkeys(state, torch.bfloat16))
    kept = []  # per version: name -> data_ptr of the tensor the encoder kept
    for version in range(1, 5):
        if version > 1:
            state = nudged(state, version)
        wire = dict(encoder.encode(state.items(), version, encoder.version, reuse_spare=reuse))
        assert {n: tensor_digest(t) for n, t in encoder.previous.items()} == \
            {n: tensor_digest(as_held(t, torch.bfloat16)) for n, t in state.items()}
        if version == 1:
            assert all(tensor_digest(wire[n]) == tensor_digest(encoder.previous[n]) for n in state)
        kept.append({n: t.data_ptr() for n, t in encoder.previous.items()})
        assert encoder.spare_version == (version - 1 if version > 1 else None)
    for name in state:  # versions 3 and 4 cast into the memory of versions 1 and 2 when told they were copied out
        assert (kept[2][name] == kept[0][name] and kept[3][name] == kept[1][name]) == reuse
