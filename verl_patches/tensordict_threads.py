"""`per_thread_device_recorder`: TensorDicts built in several threads of one process at once.

tensordict 0.10 marks one module-wide recorder while a `TensorDict(..., device=<not cuda>)` is built
(`tensordict.base._device_recorder`) and raises "Can only mark one TensorDict at a time." when another
thread builds one meanwhile. verl's worker-group calls build TensorDicts when they gather the ranks'
outputs (`concat_tensordict`), and a stage runs those calls through `asyncio.to_thread`, several at once
in a stage process, so without the patch a stage's calls can fail with that error. The patch keeps
the recorder's two flags per thread; a build marks and unmarks in its own thread, so each build sees
only its own transfers. Applied in every stage (`StateMachine.__init__`), in the driver and in the
pipeline's train workers (whose weight-staging concurrency group runs beside their training calls),
on every device.
"""

from __future__ import annotations

import threading

_FLAGS = ("marked", "_has_transfer")


def _per_thread_flag(name: str) -> property:
    def get(self):
        return getattr(self._per_thread, name, False)

    def set_(self, value):
        setattr(self._per_thread, name, value)

    return property(get, set_)


def patch_per_thread_device_recorder() -> None:
    """Make tensordict's device recorder keep its flags per thread (idempotent; the one instance that
    tensordict's modules bound by name at import is changed in place)."""
    import tensordict.base as td_base

    recorder = td_base._device_recorder
    if getattr(type(recorder), "per_thread", False):
        return
    per_thread_class = type(
        f"PerThread{type(recorder).__name__}", (type(recorder),),
        {"per_thread": True, "_per_thread": threading.local(), **{flag: _per_thread_flag(flag) for flag in _FLAGS}},
    )
    for flag in _FLAGS:
        recorder.__dict__.pop(flag, None)
    recorder.__class__ = per_thread_class
