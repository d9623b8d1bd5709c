"""verl_patches/tensordict_threads.py: TensorDicts built in several threads of one process at once.

Each test fails without the patch: tensordict 0.10 raises "Can only mark one TensorDict at a time."
when a thread builds a TensorDict while another thread's build holds the module-wide mark.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import torch
from tensordict import TensorDict

import tensordict.base as td_base
from verl_patches.tensordict_threads import patch_per_thread_device_recorder

TIMEOUT_S = 60  # only a hang reaches it


def _in_thread(fn):
    """Run fn in another thread; return (what it returned, what it raised)."""
    out = {}

    def target():
        try:
            out["value"] = fn()
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(TIMEOUT_S)
    assert not thread.is_alive()
    return out.get("value"), out.get("error")


def test_a_build_in_one_thread_does_not_see_another_threads_build_in_progress():
    patch_per_thread_device_recorder()
    recorder = td_base._device_recorder
    recorder.mark()  # this thread's build in progress, with a device transfer recorded
    recorder.record_transfer(torch.device("cpu"))
    try:
        built, error = _in_thread(lambda: TensorDict({"a": torch.zeros(2, 3)}, batch_size=[2], device="cpu"))
        assert error is None, error
        assert built["a"].shape == (2, 3)
        assert _in_thread(lambda: (recorder.marked, recorder.has_transfer()))[0] == (False, False)
        assert recorder.marked and recorder.has_transfer()  # the other thread's build left this one's flags
    finally:
        recorder.unmark()


def test_many_threads_build_tensordicts_at_once():
    patch_per_thread_device_recorder()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch inside builds: without the patch, errors in every run here
    errors = []

    def build_many():
        try:
            for i in range(2000):
                TensorDict({"a": torch.full((2,), float(i))}, batch_size=[2], device="cpu")
        except Exception as exc:  # noqa: BLE001 - the test reads it
            errors.append(exc)

    try:
        threads = [threading.Thread(target=build_many) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT_S)
    finally:
        sys.setswitchinterval(interval)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []


def test_every_stage_applies_it():
    """A stage's worker-group calls run in threads: building any StateMachine patches its process."""
    code = (
        "import tensordict.base as b\n"
        "from state_machines.base import StateMachine\n"
        "class Stage(StateMachine):\n"
        "    async def process_data(self, data):\n"
        "        return data\n"
        "before = getattr(type(b._device_recorder), 'per_thread', False)\n"
        "Stage('stage')\n"
        "print(before, getattr(type(b._device_recorder), 'per_thread', False))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]
