"""Tests for AReaL's staleness rule at batch granularity (async_rl/core/staleness.py) and the policy
clock it is applied to (async_rl/core/policy_clock.py).

The property test simulates the whole loop in one asyncio event loop, with one
`await asyncio.sleep(0)` as one tick: a generator admitting batches through the gate on its
view of the policy clock (a copy that lags the clock by a few ticks), samples decoded token by
token (each token records the version the clock says is served when it was produced, so
weights may change mid-response), a trainer that trains
batch j once its samples are done (version j -> j + 1), and a weight sync that makes
each new version served after a delay. asyncio runs ready callbacks in FIFO order, so a
given example always runs the same way.
"""

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from async_rl.core.policy_clock import ClockRef, InProcess, PolicyClock
from async_rl.core.staleness import StalenessGate, StalenessViolation, may_start_batch, sample_staleness, version_metrics


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


def test_gate_admits_against_the_served_version_or_the_steps_formed():
    gate = StalenessGate(max_staleness=1)
    assert gate.batches_ahead == 2  # the batches generation holds at once
    assert gate.admits(0, served_version=0) and gate.admits(1, 0) and not gate.admits(2, 0)
    assert gate.admits(4, 3) and not gate.admits(5, 3)
    # dynamic sampling: any batch index, against the next training batch to form
    formed = StalenessGate(max_staleness=1, steps_formed_after_generation=True)
    assert formed.admits(99, served_version=0, steps_formed=1) and not formed.admits(0, 0, steps_formed=2)
    assert formed.admits(0, served_version=1, steps_formed=2)


def test_gate_keeps_fresh_samples_and_refuses_a_stale_trained_one():
    gate = StalenessGate(max_staleness=2)
    assert gate.fresh(trainer_version=5, oldest_version=3) and not gate.fresh(5, 2)
    gate.check_trained(5, 2.0)
    with pytest.raises(StalenessViolation, match="step 5: a sample has staleness 3 > eta=2"):
        gate.check_trained(5, 3.0)


def test_gate_rejects_negative_staleness():
    with pytest.raises(ValueError, match="-1"):
        StalenessGate(max_staleness=-1)
    StalenessGate(max_staleness=0)  # 0 is synchronous, allowed


def test_clock_versions_never_go_back():
    clock = PolicyClock(start_step=3)
    assert clock.versions() == {"served_version": 0, "trained_version": 3, "steps_formed": 3}
    clock.set_served_version(2)
    with pytest.raises(ValueError, match="served version went back from 2 to 1"):
        clock.set_served_version(1)
    clock.set_served_version(2)  # the same version again is fine
    with pytest.raises(ValueError, match="steps formed went back from 3 to 2"):
        clock.set_steps_formed(2)
    clock.set_trained_version(4)
    assert clock.versions() == {"served_version": 2, "trained_version": 4, "steps_formed": 3}


def test_a_view_follows_the_clock_and_wakes_its_waiters():
    ref = ClockRef.in_process(StalenessGate(1))
    clock = ref.handle.target

    async def main():
        view = await ref.view().follow()
        assert view.served_version == 0
        await asyncio.wait_for(view.wait_until(lambda: ref.gate.admits(1, view.served_version)), 5)  # no wait
        waiter = asyncio.ensure_future(view.wait_until(lambda: ref.gate.admits(3, view.served_version)))
        await asyncio.sleep(0.02)
        assert not waiter.done()
        clock.set_served_version(1)  # 3 <= 1 + 1 is false: still waiting
        await asyncio.sleep(0.02)
        assert not waiter.done() and view.served_version == 1
        clock.set_served_version(2)  # 3 <= 2 + 1
        await asyncio.wait_for(waiter, 5)
        clock.set_steps_formed(4)
        clock.set_trained_version(2)
        await asyncio.sleep(0.02)
        assert (view.served_version, view.trained_version, view.steps_formed) == (2, 2, 4)

    run(main())


def test_a_view_wakes_every_admitted_waiter_and_only_those():
    ref = ClockRef.in_process(StalenessGate(0))
    view = ref.view()

    async def main():
        waiters = {j: asyncio.ensure_future(view.wait_until(lambda j=j: ref.gate.admits(j, view.served_version)))
                   for j in (1, 2, 3)}
        await asyncio.sleep(0.02)
        assert not any(w.done() for w in waiters.values())
        await ref.handle.set_served_version.remote(2)
        await asyncio.wait_for(asyncio.gather(waiters[1], waiters[2]), 5)
        await asyncio.sleep(0.02)
        assert not waiters[3].done()
        waiters[3].cancel()

    run(main())


def test_a_view_hands_on_lost_servers_once_each_and_follows_again_in_a_new_event_loop():
    ref = ClockRef.in_process(StalenessGate(1))
    lost = []
    view = ref.view(on_lost=lambda *report: lost.append(report))

    async def first():
        await view.follow()
        ref.handle.target.report_lost(0, "server 0", "ActorDiedError", False)
        await asyncio.sleep(0.02)

    run(first())
    assert lost == [(0, "server 0", "ActorDiedError", False)]
    ref.handle.target.set_served_version(5)

    async def second():  # a fresh event loop: the view starts following again, without repeating a report
        await view.follow()
        assert view.served_version == 5
        ref.handle.target.report_lost(1, "server 1", "no answer", True)
        await asyncio.sleep(0.02)

    run(second())
    assert lost == [(0, "server 0", "ActorDiedError", False), (1, "server 1", "no answer", True)]


def test_a_view_whose_clock_fails_raises_in_its_waiters():
    class Gone:
        def __getattr__(self, name):
            raise ConnectionError("the clock's process is gone")

    view = ClockRef(StalenessGate(0), InProcess(Gone())).view()

    async def main():
        with pytest.raises(RuntimeError, match="the policy clock stopped answering: ConnectionError"):
            await asyncio.wait_for(view.wait_until(lambda: False), 5)

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
    ref = ClockRef.in_process(StalenessGate(eta))
    clock, view = ref.handle.target, ref.view()
    done_events = [asyncio.Event() for _ in range(num_batches)]
    token_versions = [[[] for _ in batch] for batch in lengths]
    admitted_at = [None] * num_batches
    trained = []
    to_sync: asyncio.Queue = asyncio.Queue()

    async def sample(j, i):
        for _ in range(lengths[j][i]):
            token_versions[j][i].append(clock.versions()["served_version"])  # the weights decoding this token
            await tick()

    async def generate_batch(j):
        await tick(gen_delay[j])
        await asyncio.gather(*(sample(j, i) for i in range(len(lengths[j]))))
        done_events[j].set()

    async def generator():
        tasks = []
        for j in range(num_batches):
            await view.wait_until(lambda: ref.gate.admits(j, view.served_version))
            admitted_at[j] = view.served_version
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
            await ref.handle.set_served_version.remote(version)

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
