"""`python -m async_rl.sigterm_shield CMD [ARGS...]`: run CMD with SIGTERM blocked, so that it and every
process it starts outlive a scheduler's SIGTERM to the whole job (a signal mask is inherited through
fork and exec). For the Ray processes the driver does not start itself, a multi-node run's
`ray start --block` on each worker node: the driver's orderly stop needs them until it has saved
(docs/operations.md). SIGKILL still stops them, as the scheduler does after its grace period.
"""

from __future__ import annotations

import os
import signal
import sys


def main(argv: list[str]) -> None:
    """Replace this process with `argv` (searched on PATH), SIGTERM blocked; exits 2 without a command."""
    if not argv:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        raise SystemExit(2)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
