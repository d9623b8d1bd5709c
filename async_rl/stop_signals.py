"""SIGTERM / SIGINT to the driver: stop at the next step boundary with a checkpoint.

A scheduler preempting the job (SIGTERM) or Ctrl-C (SIGINT) asks the run to stop: the
driver lets the running training step finish, saves the last completed step (when
`trainer.save_freq > 0`), stops every actor and exits with 128 + the signal number, all
within `STOP_BUDGET_S`. A second signal stops at once, without the checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Optional

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOP_BUDGET_S = 45.0  # the running step and the checkpoint may take this long; the teardown follows


class PipelinePreempted(Exception):
    """The run stopped on a signal; `saved_step` is the newest checkpoint (None: none saved)."""

    def __init__(self, signum: int, saved_step: Optional[int], detail: str = ""):
        self.signum, self.saved_step = signum, saved_step
        where = f"checkpoint of step {saved_step} saved" if saved_step is not None else "no new checkpoint"
        super().__init__(f"stopped by {signal.Signals(signum).name}: {where}{'; ' + detail if detail else ''}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopRequest:
    """Set by the first stop signal; a second one raises KeyboardInterrupt (stop now)."""

    def __init__(self):
        self.signum: Optional[int] = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping without a checkpoint")
        self.signum = signum
        logger.warning("%s: finishing the running step, saving a checkpoint and stopping "
                       "(send it again to stop at once)", signal.Signals(signum).name)


@contextlib.contextmanager
def stop_signals_caught() -> Iterator[StopRequest]:
    """Within the block, SIGTERM / SIGINT set the yielded StopRequest (main thread only; elsewhere
    the signals keep their handlers and the request is never set)."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {sig: signal.signal(sig, request.handle) for sig in STOP_SIGNALS}
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
