"""A scheduler's stop: SIGTERM / SIGINT end the run at a step boundary with a checkpoint.

A scheduler stopping the job signals every process of it at once (Slurm: SIGTERM to all of a job
step's processes, SIGKILL `KillWait` = 30 s later; a terminal's Ctrl-C: SIGINT to the foreground
group). Only the driver acts on it:

- Ray's processes, and every process they start (stage actors, train workers, rollout servers,
  DataLoader workers), are started with SIGTERM blocked (`sigterm_blocked` around `ray.init`;
  a signal mask is inherited through fork and exec) and SIGINT blocked (Ray does that), so the
  signal leaves them running while the driver needs them.
- The driver (`stop_signals_caught`) lets the running training step finish, saves the last
  completed step (when `trainer.save_freq > 0`), stops every actor and Ray, and exits with
  128 + the signal number, within `trainer.stop_deadline_s` of the first signal.
- A second signal, or the deadline, stops at once without a new checkpoint: the previous one
  stays intact (verl's tracker file names it only once it is complete).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Optional

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
TEARDOWN_RESERVE_S = 6.0  # of the stop deadline, kept for stopping the actors and Ray after the save


class PipelinePreempted(Exception):
    """The run stopped on a signal; `saved_step` is the newest checkpoint this stop wrote (None: none)."""

    def __init__(self, signum: int, saved_step: Optional[int], detail: str = ""):
        self.signum, self.saved_step = signum, saved_step
        where = f"checkpoint of step {saved_step} saved" if saved_step is not None else "no new checkpoint"
        super().__init__(f"stopped by {signal.Signals(signum).name}: {where}{'; ' + detail if detail else ''}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopRequest:
    """Set by the first stop signal; a second one raises KeyboardInterrupt (stop now, no checkpoint).

    Args:
        deadline_s: seconds from the first signal to the process's exit; past it `on_deadline()` runs
            on a timer thread (it must end the process).
        on_deadline: what the deadline does (default: `hard_stop`).
    """

    def __init__(self, deadline_s: float = 25.0, on_deadline: Optional[Callable[[int], None]] = None):
        self.signum: Optional[int] = None
        self.deadline_s = deadline_s
        self.first_at: Optional[float] = None  # time.monotonic() of the first signal
        self._on_deadline = on_deadline or hard_stop
        self._timer: Optional[threading.Timer] = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def seconds_left(self) -> float:
        """Seconds until the deadline (the full deadline before any signal)."""
        if self.first_at is None:
            return self.deadline_s
        return self.deadline_s - (time.monotonic() - self.first_at)

    def handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping at once, without a checkpoint")
        self.signum, self.first_at = signum, time.monotonic()
        self._timer = threading.Timer(self.deadline_s, self._on_deadline, args=(signum,))
        self._timer.daemon = True
        self._timer.start()
        logger.warning("%s: finishing the running step, saving a checkpoint and stopping within %g s "
                       "(trainer.stop_deadline_s; send it again to stop at once)",
                       signal.Signals(signum).name, self.deadline_s)

    def cancel(self) -> None:
        """The stop is done (the process exits next): the deadline no longer applies."""
        if self._timer is not None:
            self._timer.cancel()


def hard_stop(signum: int) -> None:
    """The stop deadline passed: SIGKILL Ray's processes this driver started (their workers exit with
    the raylet) and end the process with 128 + `signum`, at once."""
    logger.error("trainer.stop_deadline_s passed: stopping at once, without a new checkpoint")
    print("async_rl: trainer.stop_deadline_s passed: stopped at once, without a new checkpoint", flush=True)
    kill_ray_processes()
    os._exit(128 + signum)


def ray_processes() -> list:
    """The Ray processes `ray.init` started in this process and every descendant of theirs (workers,
    agents), as psutil.Process; empty when this process joined a running cluster."""
    import psutil
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    found = []
    for infos in (getattr(node, "all_processes", None) or {}).values():
        for info in infos:
            with contextlib.suppress(psutil.Error, AttributeError):
                process = psutil.Process(info.process.pid)
                found += [process, *process.children(recursive=True)]
    return found


def session_processes(sid: int) -> list[int]:
    """The pids of every live process of session `sid` (a run started with start_new_session: all of
    its processes, Ray's workers included, which sit in process groups of their own)."""
    import psutil

    found = []
    for pid in psutil.pids():
        with contextlib.suppress(OSError):
            if os.getsid(pid) == sid:
                found.append(pid)
    return found


def kill_ray_processes(processes: Optional[list] = None) -> None:
    """SIGKILL `processes` (default: `ray_processes()`)."""
    import psutil

    for process in ray_processes() if processes is None else processes:
        with contextlib.suppress(psutil.Error):
            process.kill()


@contextlib.contextmanager
def sigterm_blocked() -> Iterator[None]:
    """Within the block, SIGTERM is blocked in the calling thread, so every process started from it
    (and everything those start) inherits a mask with SIGTERM blocked; the thread's mask is restored
    after. A SIGTERM arriving meanwhile is delivered when the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def stop_signals_caught(deadline_s: float = 25.0) -> Iterator[StopRequest]:
    """Within the block, SIGTERM / SIGINT set the yielded StopRequest (main thread only; elsewhere
    the signals keep their handlers and the request is never set)."""
    request = StopRequest(deadline_s)
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {sig: signal.signal(sig, request.handle) for sig in STOP_SIGNALS}
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
