"""verl's engine worker, as the pipeline's train / logp / ref_logp stages drive it.

`PipelineWorker` is verl's `ActorRolloutRefWorker` (FSDP2 engine, real forward and
backward) plus two things the pipeline needs:

- CPU runs: verl's small CPU patches (`verl_patches.cpu_patches`) applied in the
  worker process before verl builds its engine.
- weights as plain full tensors: `get_full_weights` (gather, trainer side) and
  `load_full_weights` (logp side), so that weights can travel through Ray's object
  store between separately placed worker groups (`param_update/`).
"""

from __future__ import annotations

import torch
from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker


class PipelineWorker(ActorRolloutRefWorker):
    """`ActorRolloutRefWorker` with CPU patches and full-tensor weight I/O."""

    def __init__(self, config, role: str, on_cpu: bool = False, **kwargs):
        if on_cpu:
            from verl_patches.cpu_patches import apply_cpu_worker_patches

            apply_cpu_worker_patches()
        super().__init__(config, role, **kwargs)

    def _engine(self):
        worker = self.actor if self.actor is not None else self.ref
        return worker.engine

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_full_weights(self) -> list[tuple[str, torch.Tensor]] | None:
        """Full (unsharded) HF-named tensors on CPU; rank 0 returns them, other ranks None.

        Every rank must call this: gathering FSDP2 shards is a collective.
        """
        per_tensor, _ = self._engine().get_per_tensor_param()
        named = [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in per_tensor]
        return named if torch.distributed.get_rank() == 0 else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_full_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Load full HF-named tensors into this rank's FSDP2 shards; returns tensors loaded."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        module = self._engine().module
        state = dict(named_tensors)
        set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=False))
        return len(state)
