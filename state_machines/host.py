"""Several stages in one Ray actor process.

`StageHost` is a Ray actor that builds stages and runs their state machines on its one event loop;
`HostedStage` is the handle the rest of the pipeline calls, as it calls a stage's own Ray actor
(`handle.method.remote(*args)` -> ObjectRef). A stage in its own process pays a Python start and the
imports of torch, verl and transformers: about 10 s of CPU per stage on a 2-core machine, 60% of a
CPU demo run's CPU (docs/architecture.md#stage-processes); a host pays them once per node.

Stages keep their work off the event loop (blocking calls go through `asyncio.to_thread`), so stages
sharing a host wait on each other only for the Python they run themselves. The host's thread pool
has `THREADS_PER_STAGE` threads per stage, what each had in its own process.
"""

from __future__ import annotations

import asyncio
import inspect
from concurrent.futures import ThreadPoolExecutor
from typing import Any

THREADS_PER_STAGE = 6  # asyncio's default pool on a 2-core machine: min(32, cores + 4)


class StageNotBuilt(RuntimeError):
    """A call on a hosted stage whose constructor raised; names the stage and the original error."""


class StageHost:
    """Ray actor (async) holding `stages` stages by name. `add` builds one; `call` runs one of its methods."""

    def __init__(self, stages: int):
        self._stages: dict[str, Any] = {}
        self._failed: dict[str, str] = {}
        self._threads = THREADS_PER_STAGE * max(stages, 1)
        self._pool_set = False

    async def add(self, name: str, cls: type, args: tuple, kwargs: dict) -> None:
        """Build stage `name` as `cls(*args, **kwargs)`; a failure is kept and raised by its calls."""
        self._use_own_pool()
        try:
            self._stages[name] = cls(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - raised again, named, by every call on the stage
            self._failed[name] = f"{type(exc).__name__}: {exc}"
            raise StageNotBuilt(f"stage '{name}' ({cls.__name__}) failed to start: {self._failed[name]}") from exc

    async def call(self, name: str, method: str, args: tuple, kwargs: dict) -> Any:
        """`stage.method(*args, **kwargs)`, awaited when it returns an awaitable."""
        stage = self._stages.get(name)
        if stage is None:
            why = self._failed.get(name, "it was never added to this host")
            raise StageNotBuilt(f"stage '{name}' failed to start: {why}")
        result = getattr(stage, method)(*args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result

    def _use_own_pool(self) -> None:
        """asyncio.to_thread's pool: THREADS_PER_STAGE for each stage the host holds."""
        if not self._pool_set:
            self._pool_set = True
            pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="stage")
            asyncio.get_running_loop().set_default_executor(pool)


class _HostedMethod:
    __slots__ = ("_host", "_stage", "_method")

    def __init__(self, host, stage: str, method: str):
        self._host, self._stage, self._method = host, stage, method

    def remote(self, *args, **kwargs):
        return self._host.call.remote(self._stage, self._method, args, kwargs)


class HostedStage:
    """A stage on a `StageHost`, called as a Ray actor handle is: `handle.put.remote(item)`. Picklable
    (it travels to other stages), it holds the host's handle and the stage's name."""

    def __init__(self, host, name: str):
        self.host, self.name = host, name

    def __reduce__(self):
        return (HostedStage, (self.host, self.name))

    def __getattr__(self, method: str) -> _HostedMethod:
        if method.startswith("__") or method in ("host", "name"):  # pickle's and copy's lookups
            raise AttributeError(method)
        return _HostedMethod(self.host, self.name, method)

    def __repr__(self) -> str:
        return f"HostedStage({self.name!r})"
