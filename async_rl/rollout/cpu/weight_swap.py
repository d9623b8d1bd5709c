"""Weight swaps of the CPU engine: new weights between two steps, never in the middle of a forward.

:meth:`WeightSwap.load_staged` (a complete version staged by param_update: swap of a
dual buffer's halves, or a copy) and :meth:`WeightSwap.update_weights` (full tensors)
take the same lock as a step. After an update the KV cache is dropped and every
in-flight sequence is re-prefilled with the new weights, so each token's log-prob is
exactly the one its recorded version assigns to it given the whole prefix.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping

import torch

from param_update.staging import weight_layout


class WeightSwap:
    """The weight updates of :class:`~async_rl.rollout.cpu.engine.ContinuousBatchingEngine`, which
    inherits them: they take its step lock, set its version, mark its KV cache stale and stop or
    restart its admission of requests (``model``, ``_step_lock``, ``_version``, ``_cache_stale``,
    ``_admitting``, ``_wakeup``, ``_drained``, ``_ensure_started``, ``_live_rows``).
    """

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy ``named_tensors`` into the model between steps, then set :attr:`param_version`.

        Names are ``model.state_dict()`` keys. A subset is fine (e.g. one bucket of a larger sync).
        With tied embeddings ``lm_head.weight`` may be absent or present (it aliases
        ``model.embed_tokens.weight``). All names and shapes are checked before anything is copied,
        so a bad tensor raises (KeyError / ValueError naming it) and leaves the model unchanged.
        In-flight requests keep going; their next tokens are computed from scratch under the new weights.
        """
        self._ensure_started()
        if isinstance(named_tensors, Mapping):
            named_tensors = named_tensors.items()
        updates = list(named_tensors)
        params = self.model.state_dict(keep_vars=True)
        for name, tensor in updates:
            if name not in params:
                raise KeyError(f"update_weights: unknown tensor {name!r} (not in the model's state_dict)")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(
                    f"update_weights: tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"model expects {tuple(params[name].shape)}"
                )
        async with self._step_lock:
            await asyncio.to_thread(_copy_into, params, updates)
            self._version = version
            self._cache_stale = True
        self._wakeup.set()

    def weight_layout(self):
        """(expected, aliases, tensors) of the model's weights, for a staging buffer (param_update.staging)."""
        return weight_layout(self.model.state_dict(keep_vars=True))

    def _load_targets(self) -> dict[str, torch.Tensor]:
        """Canonical name -> the model's parameter a load sets (the same objects across loads: a swap
        or a copy replaces their `.data`), found once."""
        if getattr(self, "_weight_targets", None) is None:
            self._weight_targets = self.weight_layout()[2]
        return self._weight_targets

    async def load_staged(
        self, stager, version: int, consume_bytes: int, swap: bool, interrupt: bool = True
    ) -> float:
        """load: make a complete staged version (param_update.staging) the served weights, between two steps.

        `swap` (dual buffer): the staged tensors become the weights, zero copy; else they are
        copied in, `consume_bytes` at a time. Either way no step runs meanwhile, so no token
        ever sees two versions. `interrupt` (partial rollout): running requests continue under
        the new weights (re-prefilled); False: no request is admitted until every running one
        has finished under the old weights, then the load. Returns the seconds during which
        requests could not start or continue decoding (s).
        """
        self._ensure_started()
        tensors = self._load_targets()
        start = time.perf_counter()
        try:
            if not interrupt:
                await self._wait_for_running()
            async with self._step_lock:
                locked = time.perf_counter()
                self.last_load_interrupted = self._live_rows()  # they go on under the new weights
                if swap:
                    stager.swap_into(tensors)
                else:
                    await asyncio.to_thread(stager.copy_into, tensors, consume_bytes)
                self._version = version
                self._cache_stale = True
                done = time.perf_counter()
        finally:
            self._admitting = True
            self._wakeup.set()
        return done - (start if not interrupt else locked)

    async def _wait_for_running(self) -> None:
        """Stop admitting requests; return once every admitted one has finished."""
        self._admitting = False
        self._wakeup.set()
        while True:
            self._drained.clear()  # before the check: a step that ends the last rows sets it after
            async with self._step_lock:  # not mid-step: rows being prefilled count once it ends
                if not self._live_rows():
                    return
            await self._drained.wait()


def _copy_into(params: dict[str, torch.Tensor], updates: list[tuple[str, torch.Tensor]]) -> None:
    # new private storage, not an in-place copy: swapped-in weights may be read-only object-store views
    with torch.no_grad():
        for name, tensor in updates:
            params[name].data = tensor.detach().to(device="cpu", dtype=params[name].dtype).clone()
