"""The errors the layers raise to each other, each naming its cause."""

from __future__ import annotations

from typing import Any


class AsyncConfigError(ValueError):
    """A pipeline config key has a value that cannot work: one message naming the key, the value
    and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str):
        self.key = key
        super().__init__(f"invalid config: {key}={value!r}; allowed: {allowed}")


class WeightSyncError(RuntimeError):
    """A weight version could not be delivered; every receiver keeps serving the previous one."""


class BucketSizeError(ValueError):
    """A weight-sync bucket size or room that cannot work for this model or machine (raised at start)."""


class PipelineError(RuntimeError):
    """The pipeline stopped: a stage failed, stalled, or could not start. `during_training`: the
    stages had started training (a restart from the newest checkpoint may go on)."""

    during_training = False


def is_lost_server_error(exc: BaseException) -> bool:
    """True for the errors that mean a Ray actor's process is gone or unreachable (killed, OOM,
    node lost): Ray's `ActorDiedError` and `ActorUnavailableError`."""
    import ray  # here, so that the weight path's modules import on a machine without Ray

    return isinstance(exc, ray.exceptions.RayActorError)
