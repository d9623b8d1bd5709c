"""Tests for AReaL's staleness rule at batch granularity (async_rl/core/staleness.py).

The property test simulates the whole loop in one asyncio event loop, with one
`await asyncio.sleep(0)` as one tick: a generator admitting batches through the
StalenessController, samples decoded token by token (each token records the version
served when it was produced, so weights may change mid-response), a trainer that trains
batch j once its samples are done (version j -> j + 1), and a weight sync that makes
each new version served after a delay. asyncio runs ready callbacks in FIFO order, so a
given example always runs the same way.
"""

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from async_rl.core.staleness import StalenessController, may_start_batch, sample_staleness, version_metrics


def run(coro, timeout=30):
    return asyncio.run(asyncio.wait_for(coro, timeout))


# ---- the rule ---------------------------------------------------------------------


def test_synchronous_k1_admits_batch_j_only_at_version_j():
    eta = 0  # generate_ahead_steps k = 1
    assert may_start_batch(0, 0, eta)
    assert not may_start_batch(1, 0, eta)
    assert may_start_batch(1, 1, eta)
    assert not may_start_batch(5, 4, eta)
    assert may_start_batch(5, 5, eta)
    # the first version at which each batch is admitted is its own index
    for j in range(8):
        assert min(v for v in range(20) if may_start_batch(j, v, eta)) == j


def test_k3_admits_two_batches_ahead():
    eta = 2  # generate_ahead_steps k = 3
    assert may_start_batch(0, 0, eta) and may_start_batch(1, 0, eta) and may_start_batch(2, 0, eta)
    assert not may_start_batch(3, 0, eta)
    assert may_start_batch(3, 1, eta)
    assert may_start_batch(7, 5, eta) and not may_start_batch(8, 5, eta)
    for v in range(6):
        assert [j for j in range(12) if may_start_batch(j, v, eta)] == list(range(v + 3))


def test_sample_staleness():
    assert sample_staleness(5, 5) == 0
    assert sample_staleness(5, 3) == 2
    assert sample_staleness(0, 0) == 0


def test_controller_may_start_follows_served_version():
    ctrl = StalenessController(max_staleness=1)
    assert ctrl.served_version == 0
    assert ctrl.may_start(0) and ctrl.may_start(1) and not ctrl.may_start(2)
    run(ctrl.set_served_version(3))
    assert ctrl.served_version == 3
    assert ctrl.may_start(4) and not ctrl.may_start(5)


def test_controller_initial_version():
    ctrl = StalenessController(max_staleness=0, initial_version=4)
    assert ctrl.may_start(4) and not ctrl.may_start(5)


def test_controller_rejects_negative_staleness():
    with pytest.raises(ValueError, match="-1"):
        StalenessController(max_staleness=-1)
    StalenessController(max_staleness=0)  # 0 is synchronous, allowed


def test_served_version_never_goes_back():
    ctrl = StalenessController(max_staleness=0)

    async def main():
        await ctrl.set_served_version(2)
        with pytest.raises(ValueError, match="from 2 to 1"):
            await ctrl.set_served_version(1)
        assert ctrl.served_version == 2
        await ctrl.set_served_version(2)  # same version again is fine
        assert ctrl.served_version == 2

    run(main())


def test_wait_until_admitted_unblocks_when_version_advances():
    ctrl = StalenessController(max_staleness=1)

    async def main():
        await asyncio.wait_for(ctrl.wait_until_admitted(1), 5)  # admitted already: no wait
        waiter = asyncio.ensure_future(ctrl.wait_until_admitted(3))
        await asyncio.sleep(0.02)
        assert not waiter.done()
        await ctrl.set_served_version(1)  # 3 <= 1 + 1 is false: still waiting
        await asyncio.sleep(0.02)
        assert not waiter.done()
        await ctrl.set_served_version(2)  # 3 <= 2 + 1
        await asyncio.wait_for(waiter, 5)

    run(main())


def test_wait_until_admitted_wakes_every_admitted_waiter():
    ctrl = StalenessController(max_staleness=0)

    async def main():
        waiters = {j: asyncio.ensure_future(ctrl.wait_until_admitted(j)) for j in (1, 2, 3)}
        await asyncio.sleep(0.02)
        assert not any(w.done() for w in waiters.values())
        await ctrl.set_served_version(2)
        await asyncio.wait_for(asyncio.gather(waiters[1], waiters[2]), 5)
        await asyncio.sleep(0.02)
        assert not waiters[3].done()
        waiters[3].cancel()

    run(main())


# ---- the whole loop, simulated ------------------------------------------------------


async def tick(n=1):
    for _ in range(n):
        await asyncio.sleep(0)


async def simulate(eta, lengths, sync_delays, train_ticks, gen_delay):
    """Run the generator / trainer / weight-sync loop; return per-batch results.

    lengths[j]: response lengths of batch j's samples; sync_delays[j]: ticks before
    version j + 1 is served; train_ticks[j]: ticks to train batch j; gen_delay[j]: ticks
    between admission of batch j and its samples starting.
    """
    num_batches = len(lengths)
    ctrl = StalenessController(eta)
    done_events = [asyncio.Event() for _ in range(num_batches)]
    token_versions = [[[] for _ in batch] for batch in lengths]
    admitted_at = [None] * num_batches
    trained = []
    to_sync: asyncio.Queue = asyncio.Queue()

    async def sample(j, i):
        for _ in range(lengths[j][i]):
            token_versions[j][i].append(ctrl.served_version)  # the weights decoding this token
            await tick()

    async def generate_batch(j):
        await tick(gen_delay[j])
        await asyncio.gather(*(sample(j, i) for i in range(len(lengths[j]))))
        done_events[j].set()

    async def generator():
        tasks = []
        for j in range(num_batches):
            await ctrl.wait_until_admitted(j)
            admitted_at[j] = ctrl.served_version
            tasks.append(asyncio.ensure_future(generate_batch(j)))  # samples of several batches interleave
        await asyncio.gather(*tasks)

    async def trainer():
        version = 0
        for j in range(num_batches):
            await done_events[j].wait()
            assert version == j  # batch j is trained by the update j -> j + 1
            staleness = [sample_staleness(version, min(tv)) for tv in token_versions[j]]
            await tick(train_ticks[j])
            version += 1
            trained.append((j, staleness))
            await to_sync.put(version)

    async def weight_sync():
        for j in range(num_batches):
            version = await to_sync.get()
            await tick(sync_delays[j])
            await ctrl.set_served_version(version)

    await asyncio.gather(generator(), trainer(), weight_sync())
    return trained, token_versions, admitted_at


@st.composite
def loops(draw):
    eta = draw(st.integers(0, 4))
    num_batches = draw(st.integers(1, 7))
    lengths = [draw(st.lists(st.integers(1, 50), min_size=1, max_size=3)) for _ in range(num_batches)]
    sync_delays = draw(st.lists(st.integers(0, 60), min_size=num_batches, max_size=num_batches))
    train_ticks = draw(st.lists(st.integers(0, 20), min_size=num_batches, max_size=num_batches))
    gen_delay = draw(st.lists(st.integers(0, 10), min_size=num_batches, max_size=num_batches))
    return eta, lengths, sync_delays, train_ticks, gen_delay


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(loops())
def test_no_trained_sample_is_staler_than_eta(loop):
    eta, lengths, sync_delays, train_ticks, gen_delay = loop
    trained, token_versions, admitted_at = run(simulate(eta, lengths, sync_delays, train_ticks, gen_delay))

    assert [j for j, _ in trained] == list(range(len(lengths)))  # every batch trained, in order
    for j, staleness in trained:
        assert len(staleness) == len(lengths[j])
        assert all(0 <= s <= eta for s in staleness), (j, staleness, token_versions[j])
        assert admitted_at[j] + eta >= j
        for tv in token_versions[j]:
            assert tv == sorted(tv)  # the served version never goes back during a response
            assert max(tv) <= j  # nothing newer than the trainer can be served
        if eta == 0:
            assert staleness == [0] * len(lengths[j])
            assert all(set(tv) == {j} for tv in token_versions[j])
        metrics = batch_version_metrics(token_versions[j], admitted_at[j], j, eta)
        assert metrics["async/staleness/max"] == max(staleness) <= eta
        hist = [metrics[f"async/staleness/hist_{s}"] for s in range(eta + 1)]
        assert hist == pytest.approx([staleness.count(s) / len(staleness) for s in range(eta + 1)])
        spanned = [len(set(tv)) for tv in token_versions[j]]
        assert metrics["async/partial/max_versions_spanned"] == max(spanned) <= eta + 1
        assert metrics["async/partial/ratio"] == pytest.approx(sum(n > 1 for n in spanned) / len(spanned))


def batch_version_metrics(versions: list[list[int]], start_version: int, trainer_version: int, eta: int) -> dict:
    """version_metrics of one simulated batch, padded as async_rl/core/messages.py pads it (-1, mask 0)."""
    import torch

    width = max(len(v) for v in versions) + 2
    padded = torch.full((len(versions), width), -1, dtype=torch.long)
    mask = torch.zeros_like(padded)
    for i, v in enumerate(versions):
        padded[i, : len(v)] = torch.tensor(v)
        mask[i, : len(v)] = 1
    return version_metrics(padded, mask, [start_version] * len(versions), trainer_version, eta)


def test_simulation_reaches_the_bound():
    """The controller does let generation run ahead: with slow weight syncs every batch
    j >= eta starts on version j - eta, so the staleness bound is reached, not just kept."""
    for eta in range(4):
        n = 6
        trained, token_versions, admitted_at = run(
            simulate(eta, [[5, 5]] * n, sync_delays=[200] * n, train_ticks=[0] * n, gen_delay=[0] * n)
        )
        assert admitted_at == [max(0, j - eta) for j in range(n)]
        assert [max(s) for _, s in trained] == [min(j, eta) for j in range(n)]


def test_simulation_sees_weights_change_mid_response():
    """Long responses in flight while a sync lands get tokens from two versions."""
    trained, token_versions, _ = run(
        simulate(1, [[3], [50], [3]], sync_delays=[5, 5, 5], train_ticks=[0, 0, 0], gen_delay=[0, 0, 0])
    )
    assert token_versions[1][0][0] == 0 and token_versions[1][0][-1] == 1
    assert [s for _, s in trained] == [[0], [1], [1]]
