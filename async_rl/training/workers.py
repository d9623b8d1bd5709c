"""verl's engine worker, as the pipeline's train / logp / ref_logp stages drive it.

`PipelineWorker` is verl's `ActorRolloutRefWorker` (FSDP2 engine, real forward and
backward) plus what the pipeline needs:

- CPU runs: verl's small CPU patches (`verl_patches.cpu_patches`) applied in the
  worker process before verl builds its engine.
- the training side of the weight sync (`send_weight_buckets`: gather + send,
  param_update/sender.py) and the receiving side for logp workers
  (param_update/holder.py `RankStagedWeights`; its load is `load_staged`, into the FSDP2 shards).
  Staging runs in its own concurrency group ("weights"), so a logp worker registers buckets of
  version v while it computes with v - 1; loading runs in the default group, never beside a forward.
- checkpoints written beside training (`snapshot_checkpoint`, async_rl/training/checkpoint_writer.py):
  verl's own `save_checkpoint` with its writes deferred to a thread; the wait for that
  thread runs in its own concurrency group ("checkpoint"). Loading is verl's `load_checkpoint`, its
  files read with `weights_only=True` (verl_patches/weights_only_checkpoint_load.py).
"""

from __future__ import annotations

import ray
import torch
from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from async_rl.training import proximal_loss  # noqa: F401 (registers the log-linear pi_prox loss in verl's table)
from async_rl.training.checkpoint_writer import CheckpointWriter
from param_update.buckets import tensor_digest
from param_update.holder import WEIGHTS_GROUP, RankStagedWeights
from param_update.lora import LoraAdapter, adapter_of, is_adapter_key, sent_name, served_state
from param_update.sender import BucketSender, live_storage_addresses
from param_update.staging import VersionStager
from verl_patches.cpu_patches import apply_cpu_worker_patches
from verl_patches.deferred_checkpoint_write import hold_optimizer_step
from verl_patches.tensordict_threads import patch_per_thread_device_recorder
from verl_patches.weights_only_checkpoint_load import patch_weights_only_checkpoint_load

CHECKPOINT_GROUP = "checkpoint"  # waits for a checkpoint's background write, beside training
CONCURRENCY_GROUPS = {WEIGHTS_GROUP: 1, CHECKPOINT_GROUP: 1}


class PipelineWorker(ActorRolloutRefWorker, RankStagedWeights):
    """`ActorRolloutRefWorker` with CPU patches and bucketed weight send / receive."""

    def __init__(self, config, role: str, on_cpu: bool = False, **kwargs):
        if on_cpu:
            apply_cpu_worker_patches()
        patch_per_thread_device_recorder()  # its concurrency groups' calls run beside the default group's
        patch_weights_only_checkpoint_load()  # a resume unpickles nothing
        super().__init__(config, role, **kwargs)
        self._bucket_sender = None
        self._checkpoint_writer = None
        self._adapter = None  # LoraAdapter under LoRA (found once), False without

    def _engine(self):
        worker = self.actor if self.actor is not None else self.ref
        return worker.engine

    def _lora(self) -> LoraAdapter | None:
        """The model's LoRA adapter (param_update/lora.py), None when it has none."""
        if self._adapter is None:
            module = self._engine().module
            peft_model = getattr(module, "_fsdp_wrapped_module", module)
            self._adapter = adapter_of(peft_model) if hasattr(peft_model, "peft_config") else False
        return self._adapter or None

    def _sent_tensors(self):
        """(name, full tensor) of what a version carries (collective): verl's per-tensor weights, or
        under LoRA the adapter's tensors alone (the base is frozen, and every receiver has it)."""
        engine = self._engine()
        if self._lora() is None:
            return engine.get_per_tensor_param()[0]
        from verl.utils.fsdp_utils import collect_lora_params

        layered = bool(self.config.rollout.get("layered_summon", False))
        return collect_lora_params(engine.module, layered_summon=layered, base_sync_done=True).items()

    def _full_state(self):
        """(module key, full tensor) of every weight of this rank's model (collective)."""
        for key, tensor in self._engine().module.state_dict().items():
            yield key, tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def lora_adapter(self) -> LoraAdapter | None:
        """The adapter the receivers merge (None without LoRA)."""
        return self._lora()

    # ---- training side: gather + send ------------------------------------------------
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def send_weight_buckets(self, version: int, bucket_bytes: int, sink) -> dict[str, float]:
        """gather (collective: every rank must call it) and hand rank 0's buckets to its send thread.

        Returns `{"gather_s": ...}` as soon as the gather is done; the buckets reach `sink`
        (the param_update stage) from the send thread while training goes on.
        """
        if self._bucket_sender is None:
            self._bucket_sender = BucketSender()
        engine = self._engine()
        live = live_storage_addresses(engine.module.state_dict().values())
        per_tensor = self._sent_tensors()
        is_sender = torch.distributed.get_rank() == 0
        return self._bucket_sender.gather_and_send(per_tensor, version, bucket_bytes, sink, is_sender, live)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    @ray.method(concurrency_group=WEIGHTS_GROUP)
    def close_weight_sender(self) -> None:
        """Unlink the send's shared-memory files (the pipeline's shutdown); runs beside training."""
        if self._bucket_sender is not None:
            self._bucket_sender.close()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weight_layout(self) -> dict[str, tuple]:
        """Name -> (dtype, global shape) of what `send_weight_buckets` sends (no data moves): HF names,
        or under LoRA the adapter's tensors under PEFT's names."""
        return {name: (t.dtype, tuple(t.shape)) for name, (key, t) in self._sent_keys().items()}

    def _sent_keys(self) -> dict[str, tuple[str, torch.Tensor]]:
        """Sent name -> (module key, the module's tensor) of what a version carries."""
        from verl.utils.model import convert_weight_keys

        module = self._engine().module
        state = module.state_dict()
        if self._lora() is not None:
            return {sent_name(key): (key, t) for key, t in state.items() if is_adapter_key(sent_name(key))}
        names = convert_weight_keys({key: key for key in state}, getattr(module, "_fsdp_wrapped_module", module))
        return {name: (key, state[key]) for name, key in names.items()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weight_digests(self) -> dict[str, str] | None:
        """HF name -> digest of the full weights (collective; rank 0 returns them, others None); under
        LoRA of the weights a receiver serves: the base with the adapter merged (param_update/lora.py)."""
        adapter = self._lora()
        per_tensor = self._engine().get_per_tensor_param()[0] if adapter is None else \
            served_state(self._full_state(), adapter).items()
        digests = {name: tensor_digest(t) for name, t in per_tensor}
        return digests if torch.distributed.get_rank() == 0 else None

    # ---- checkpoints: snapshot now, files from a background thread -------------------------
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def snapshot_checkpoint(self, local_path: str, global_step: int) -> dict[str, float]:
        """verl's save_checkpoint into `local_path` (collective), its tensors copied and written in the
        background (async_rl/training/checkpoint_writer.py).

        verl's own rotation is off (`max_ckpt_to_keep=None`): the pipeline keeps whole steps
        (async_rl/checkpoints.py). Returns {"snapshot_s": seconds training waited}.
        """
        if self._checkpoint_writer is None:
            self._checkpoint_writer = CheckpointWriter()
            # the captured state is the live state: the next optimizer step waits for its copy
            hold_optimizer_step(self._engine(), self._checkpoint_writer.wait_copied)
        return self._checkpoint_writer.snapshot(
            lambda: self.actor.save_checkpoint(local_path, None, global_step, None), global_step
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    @ray.method(concurrency_group=CHECKPOINT_GROUP)
    def wait_checkpoint_written(self, timeout_s: float) -> dict[str, float]:
        """Block until this rank's checkpoint files are on disk; {"copy_s", "write_s", "bytes"} (empty: none)."""
        if self._checkpoint_writer is None:
            return {}
        return self._checkpoint_writer.wait(timeout_s)

    # ---- receiving side (logp): staging set up, the load ----------------------------------
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def configure_weight_sync(self) -> None:
        """Set up this rank's staging (a load into FSDP2 shards is always a copy).

        Names are what the trainer sends (`weight_layout`: HF names, or the adapter's under LoRA, which
        this PEFT model loads as they are), shapes global.
        """
        sent = self._sent_keys()
        self._module_key = {name: key for name, (key, _) in sent.items()}  # sent name -> module key
        self.start_staging({name: (t.dtype, tuple(t.shape)) for name, (_, t) in sent.items()})

    def load_staged(self, version: int, staged: VersionStager, consume_bytes: int) -> int:
        """load (`commit_weights`): the staged version into this rank's FSDP2 shards, `consume_bytes` at
        a time; returns tensors loaded."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        module = self._engine().module
        options = StateDictOptions(full_state_dict=True, strict=False)
        loaded, group, group_bytes = 0, {}, 0
        for name, tensor in staged.named_tensors():
            group[self._module_key[name]] = tensor
            group_bytes += tensor.nbytes
            if group_bytes >= consume_bytes:
                set_model_state_dict(module, group, options=options)
                loaded, group, group_bytes = loaded + len(group), {}, 0
        if group:
            set_model_state_dict(module, group, options=options)
            loaded += len(group)
        staged.reset()
        return loaded


class CriticWorker(TrainingWorker):
    """verl's critic: the engine `TrainingWorker` verl 0.9.1's trainer builds for `critic`
    (a value model), with the CPU patches applied in its process first."""

    def __init__(self, config, on_cpu: bool = False):
        if on_cpu:
            apply_cpu_worker_patches()
        patch_weights_only_checkpoint_load()  # a resume unpickles nothing
        super().__init__(config)
