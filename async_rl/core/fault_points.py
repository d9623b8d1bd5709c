"""Named points where a test or bench may hold a process, to kill the run exactly there.

With `ASYNC_RL_HOLD_AT="<point>@<step>"` (several: comma-separated) and `ASYNC_RL_HOLD_DIR`
in the environment, the process that reaches `<point>` at `<step>` writes the file
`<dir>/<point>@<step>` and waits there, so the caller can SIGKILL every process of the run
while that work is in progress, or let it go on by creating `<dir>/<point>@<step>.release`.
Unset (always, outside tests and `bench/`), `hold_at` returns at once. The points:

- `train_step@N`: actor_train, training step N updated the weights, nothing of it sent or saved;
- `weight_sync@N`: param_update, version N staged on every receiver, not yet loaded;
- `generate_ahead@N`: generate, the batch of step N generated (started ahead of the trainer: under a version
  below N - 1), not yet passed on;
- `checkpoint_copy@N`: a train rank's writer thread, checkpoint N captured, its tensors not yet copied;
- `checkpoint_write@N`: a train rank's writer thread, checkpoint N copied, none of its big files written;
- `checkpoint_commit@N`: every file of checkpoint N written and flushed in `global_step_N.partial`, not renamed;
- `checkpoint_swap@N`: saving step N again, the older `global_step_N` moved aside, the new one not yet in place;
- `checkpoint_tracker@N`: `global_step_N` in place, the tracker not yet naming it;
- `checkpoint_rotate@N`: the tracker names N, an older checkpoint moved aside for removal, not yet deleted.

With `ASYNC_RL_DELAY="<point>@<index>=<seconds>"` (several: comma-separated), `delay_for(point,
index)` gives that delay (else 0), to make one part slow: `rollout_replica@I`, every request
on rollout replica I (the CPU backend) waits that long before it decodes.
"""

from __future__ import annotations

import os
import time

HOLD_AT_ENV = "ASYNC_RL_HOLD_AT"
HOLD_DIR_ENV = "ASYNC_RL_HOLD_DIR"
DELAY_ENV = "ASYNC_RL_DELAY"


def hold_at(point: str, step: int) -> None:
    """Hold the calling thread (until killed or released) if the environment asks for `point@step`."""
    wanted = os.environ.get(HOLD_AT_ENV)
    if not wanted or f"{point}@{step}" not in wanted.split(","):
        return
    marker = os.path.join(os.environ.get(HOLD_DIR_ENV) or ".", f"{point}@{step}")
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    while not os.path.exists(marker + ".release"):
        time.sleep(0.05)


def delay_for(point: str, index: int) -> float:
    """Seconds `point` of `index` is to wait, as `ASYNC_RL_DELAY` asks (0.0 when it does not)."""
    for entry in (os.environ.get(DELAY_ENV) or "").split(","):
        where, _, seconds = entry.partition("=")
        if where.strip() == f"{point}@{index}":
            return float(seconds)
    return 0.0
