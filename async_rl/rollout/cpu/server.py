"""CPU rollout server: the Ray actor behind :class:`async_rl.rollout.cpu.replica.CPURolloutReplica`.

It mirrors the method names of verl's ``vLLMHttpServer`` / ``SGLangHttpServer`` so verl's
replica, load balancer and LLM-server client can drive it unchanged, but serves
token-in/token-out ``generate`` calls from an in-process
:class:`~async_rl.rollout.cpu.engine.ContinuousBatchingEngine` instead of an HTTP engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional

import ray
import torch
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.tokenizer.tokenizer import normalize_token_ids
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.replica import RolloutMode, TokenOutput

from async_rl.core.fault_points import delay_for
from async_rl.core.node_address import bind_socket, service_host
from async_rl.rollout.cpu.engine import ContinuousBatchingEngine
from async_rl.rollout.cpu.options import CpuEngineOptions
from async_rl.rollout.cpu.requests import STOP_ABORTED
from param_update.buckets import tensor_digest
from param_update.holder import AsyncStagedWeights
from param_update.lora import LoraAdapter, MergedVersion, adapter_from_peft_config, base_weights
from param_update.staging import VersionStager, layout_mismatches

logger = logging.getLogger(__name__)


class CPURolloutServer(AsyncStagedWeights):
    """Serve one rollout replica on CPU; a weight holder (param_update/holder.py) whose load swaps or
    copies a staged version into the engine between decoding steps.

    Args:
        config: verl ``RolloutConfig`` (dataclass or DictConfig). Used: ``max_model_len``,
            ``prompt_length``/``response_length`` (default token budget), ``max_num_seqs``,
            ``max_num_batched_tokens`` (prefill chunk, tokens), ``seed``, ``ignore_eos``, ``engine_kwargs.cpu``
            (the engine's own options: async_rl/rollout/cpu/options.py).
        model_config: verl ``HFModelConfig``; the model is loaded from ``model_config.local_path``.
        replica_rank: rank of the replica; the sampling seed is ``config.seed + replica_rank``.
        rollout_mode: kept for parity with verl's servers; CPU behaves the same in every mode.
        node_rank, nnodes, workers: accepted for signature parity; a CPU replica is one process.
    """

    def __init__(
        self,
        config: RolloutConfig,
        model_config: HFModelConfig,
        replica_rank: int = 0,
        rollout_mode: RolloutMode = RolloutMode.STANDALONE,
        node_rank: int = 0,
        nnodes: int = 1,
        workers: Optional[list] = None,
        **kwargs: Any,
    ):
        self.config: RolloutConfig = omega_conf_to_dataclass(config, dataclass_type=RolloutConfig)
        self.model_config: HFModelConfig = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.engine_options = CpuEngineOptions.from_rollout_config(self.config)
        self.replica_rank = replica_rank
        self.rollout_mode = rollout_mode
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.engine: Optional[ContinuousBatchingEngine] = None
        self.max_model_len: Optional[int] = self.config.max_model_len
        self._rejecting = False  # set by abort_all_requests(reject_request=True) until resume_generation()
        self._consume_bytes = 0
        self._adapter: Optional[LoraAdapter] = None  # LoRA: versions are adapters, merged onto _lora_base
        self._lora_base: dict[str, torch.Tensor] = {}  # HF name -> base weight (as loaded) an adapter changes
        self._image_processor = None  # a vision-language model's, loaded at its first request with images

        # There is no HTTP endpoint. The port is reserved (bound on the node's service address, never
        # listening: nothing can connect) only so that "ip:port" is unique per replica: verl's load
        # balancer keys servers by that address.
        self._server_address = service_host()
        self._port_socket = bind_socket(self._server_address)
        self._server_port = self._port_socket.getsockname()[1]

    # ------------------------------------------------------------------ lifecycle

    async def launch_server(self, *args: Any, **kwargs: Any) -> None:
        """Load the model (float32, sdpa) and start the engine. Extra args are ignored."""
        if self.engine is not None:
            return
        engine = await asyncio.to_thread(
            ContinuousBatchingEngine.from_pretrained,
            self.model_config.local_path,
            eos_token_ids=_eos_ids(self.model_config) or None,
            seed=int(self.config.seed) + self.replica_rank,
            max_num_seqs=int(self.config.max_num_seqs),
            max_model_len=self.config.max_model_len,
            max_prefill_tokens=int(self.config.max_num_batched_tokens),
            admission_window_s=self.engine_options.admission_window_ms / 1e3,
        )
        self.max_model_len = engine.max_model_len
        self.engine = engine
        logger.info("CPU rollout server %d up: %s, max_model_len=%d", self.replica_rank, self.model_config.local_path,
                    engine.max_model_len)

    def get_server_address(self) -> tuple[str, int]:
        """(node ip, reserved port). Nothing listens on the port; see the constructor."""
        return self._server_address, self._server_port

    def get_rollout_config(self) -> RolloutConfig:
        return self.config

    # ------------------------------------------------------------------ generation

    async def generate(
        self,
        prompt_ids: Any,
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Optional[list[Any]] = None,
        video_data: Optional[list[Any]] = None,
        **kwargs: Any,
    ) -> TokenOutput:
        """Token-in/token-out generation, as ``vLLMHttpServer.generate``.

        ``max_new_tokens`` (or ``max_tokens``) defaults to
        ``min(response_length, prompt_length + response_length - len(prompt_ids))`` and is clamped to
        ``max_model_len - len(prompt_ids)``. ``log_probs`` are always returned (see
        ``cpu_sampling``); ``extra_fields`` carries ``token_versions`` (weight version per token),
        ``param_version`` (engine version at return), and verl's ``global_steps`` /
        ``min_global_steps`` / ``max_global_steps`` derived from them. ``stop_reason`` is
        "completed" (eos, stop token or length) or "aborted". ``image_data``: the prompt's images (PIL), whose
        tokens the prompt holds expanded; a vision-language model only (the model's image processor reads them).
        ``prompt_logprobs`` (an int K >= 0, vLLM's parameter): ``extra_fields`` also carries ``prompt_ids`` and
        ``prompt_logprobs``, vLLM's layout as verl reads it (async_rl/rollout/cpu/prompt_logprobs.py): what a
        distillation teacher serves.
        """
        if video_data:
            raise NotImplementedError("the CPU rollout server takes images, not videos (got video_data)")
        if self.engine is None:
            raise RuntimeError("launch_server() has not been called")
        vision_inputs = await asyncio.to_thread(self._vision_inputs, image_data) if image_data else None
        delay = delay_for("rollout_replica", self.replica_rank)
        if delay:
            await asyncio.sleep(delay)  # a slow replica, as a test asks (async_rl/core/fault_points.py)
        prompt_ids = normalize_token_ids(prompt_ids)
        params = dict(sampling_params or {})
        max_possible = self.max_model_len - len(prompt_ids)
        if max_possible < 1:
            raise ValueError(
                f"Prompt length ({len(prompt_ids)}) leaves no room to generate within max_model_len "
                f"({self.max_model_len})"
            )
        default = min(self.config.response_length,
                      self.config.prompt_length + self.config.response_length - len(prompt_ids))
        given = [params.pop(key, None) for key in ("max_new_tokens", "max_tokens")]  # sglang's name, vLLM's
        max_new = next((value for value in given if value is not None), default)
        params["max_new_tokens"] = max(0, min(int(max_new), max_possible))
        params.setdefault("ignore_eos", self.config.ignore_eos)

        top_k = params.pop("prompt_logprobs", None)
        if top_k is not None and vision_inputs is not None:
            raise NotImplementedError("the CPU rollout server scores prompts of text only (prompt_logprobs with images)")

        if self.engine.paused and self._rejecting:
            return self._output([], [], [], STOP_ABORTED)
        scored = await self.engine.prompt_logprobs(prompt_ids, int(top_k)) if top_k is not None else None
        result = await self.engine.generate(prompt_ids, params, request_id, vision_inputs=vision_inputs)
        stop_reason = "aborted" if result.stop_reason == STOP_ABORTED else "completed"
        output = self._output(result.token_ids, result.log_probs, result.token_versions, stop_reason)
        if scored is not None:
            output.extra_fields["prompt_ids"], output.extra_fields["prompt_logprobs"] = (t.tolist() for t in scored)
        return output

    def _vision_inputs(self, images: list[Any]) -> dict[str, torch.Tensor]:
        """The model's image processor's outputs for `images` (loaded at the first request with images)."""
        if self.engine.rope is None:
            raise ValueError(f"images sent to {self.model_config.local_path}, a model without a vision tower")
        if self._image_processor is None:
            # the auto class itself: transformers' top-level name is a placeholder without torchvision
            from transformers.models.auto.image_processing_auto import AutoImageProcessor

            self._image_processor = AutoImageProcessor.from_pretrained(self.model_config.local_path)
        return dict(self._image_processor(images=list(images), return_tensors="pt"))

    def _output(self, token_ids: list[int], log_probs: list[float], versions: list[int], stop: str) -> TokenOutput:
        version = self.engine.param_version
        return TokenOutput(
            token_ids=token_ids,
            log_probs=log_probs,
            stop_reason=stop,
            num_preempted=0,
            extra_fields={
                "token_versions": versions,
                "param_version": version,
                "global_steps": version,
                "min_global_steps": min(versions) if versions else version,
                "max_global_steps": max(versions) if versions else version,
            },
        )

    async def abort_all_requests(self, reject_request: bool = False, **kwargs: Any) -> dict[str, Any]:
        """Pause the engine and abort every in-flight request (each returns its partial tokens).

        The engine stays paused until :meth:`resume_generation`: requests arriving meanwhile wait,
        or, with ``reject_request=True``, return at once with no tokens and "aborted".
        Returns ``{"aborted_count", "request_ids"}`` like vLLM's server.
        """
        self._rejecting = reject_request
        await self.engine.pause()
        request_ids = self.engine.abort_all()
        return {"aborted_count": len(request_ids), "request_ids": request_ids}

    async def abort_request(self, request_id: str, **kwargs: Any) -> dict[str, Any]:
        """Abort one request; it returns its partial tokens with "aborted"."""
        return {"aborted": self.engine.abort(request_id), "request_id": request_id}

    async def resume_generation(self) -> None:
        """Undo :meth:`abort_all_requests`: waiting and new requests decode again."""
        self._rejecting = False
        self.engine.resume()

    # ------------------------------------------------------------------ weights

    async def update_weights(self, named_tensors: Any, version: int) -> None:
        """Load ``named_tensors`` (list of ``(name, tensor)`` pairs or a dict) between decode steps
        and set the weight version to ``version``. All-or-nothing; see the engine. The tensors loaded
        are the base an adapter (`update_adapter`) is merged onto from then on."""
        if isinstance(named_tensors, dict):
            named_tensors = list(named_tensors.items())
        named = [(name, t if isinstance(t, torch.Tensor) else torch.as_tensor(t)) for name, t in named_tensors]
        await self.engine.update_weights(named, version)
        if self._staging is not None:
            self._staging.stager.release_serving()  # the engine copied the weights into its own memory
        self._lora_base.update((name, t.detach().clone()) for name, t in named if name in self._lora_base)

    async def update_adapter(self, named_tensors: list, peft_config: dict, version: int) -> None:
        """Serve base + a LoRA adapter (`lora_A` / `lora_B` tensors under PEFT's names, with PEFT's config
        dict: what verl's own trainer sends) from the next decode step, as `version`: each adapted
        weight is its base (as loaded) merged with the adapter (param_update/lora.py)."""
        adapter = adapter_from_peft_config(peft_config, [name for name, _ in named_tensors])
        if self._adapter != adapter:
            self._use_adapter(adapter)
        merged = adapter.merged(self._lora_base, dict(named_tensors))
        await self.engine.update_weights(list(merged), version)

    def _use_adapter(self, adapter: LoraAdapter) -> None:
        """Keep a copy of the weights `adapter` changes, as loaded now: what its versions merge onto."""
        self._lora_base = base_weights(self.engine.model.state_dict(), adapter)
        self._adapter = adapter

    async def get_param_version(self) -> int:
        return self.engine.param_version

    # ------------------------------------------------------------------ weights, in buckets (param_update/)

    def configure_weight_sync(
        self, dual_buffer: bool, consume_bucket_bytes: int, sender_layout=None, partial_rollout: bool = True,
        adapter: Optional[LoraAdapter] = None,
    ) -> None:
        """Set up staging: `dual_buffer` loads by swapping in the staged version, else by copying it.
        `partial_rollout`: a load interrupts running requests (else it waits for them to finish).
        `adapter` (LoRA): a version carries the adapter's tensors only, and a load serves them merged
        onto the weights this server loaded (param_update/lora.py).

        `sender_layout` (name -> (dtype, shape), the trainer's) is checked against this model
        now, so a mismatch fails at start rather than at the first sync.
        """
        expected, aliases, _ = self.engine.weight_layout()
        if adapter is not None:
            self._use_adapter(adapter)
            if sender_layout is None:
                raise ValueError("an adapter's weight sync needs the trainer's layout of its tensors")
            expected, aliases = {name: sender_layout[name] for name in adapter.sent_names}, {}
            problems = [f"the adapter changes {name!r}, which this server's model does not have"
                        for name in adapter.weights if name not in self._lora_base]
        else:
            problems = layout_mismatches(sender_layout, expected, aliases) if sender_layout is not None else []
        if problems:
            raise ValueError(
                f"rollout server {self.replica_rank} cannot take the trainer's weights: " + "; ".join(problems[:5])
            )
        self.start_staging(expected, aliases)
        self._dual_buffer = dual_buffer
        self._consume_bytes = int(consume_bucket_bytes)
        self._interrupt = partial_rollout

    async def load_staged(self, version: int, staged: VersionStager) -> dict[str, float]:
        """load: serve the staged `version` from the next decoding step on. `keeps_buffer`: the
        staged views now serve (dual buffer), else they were copied and released."""
        start = time.perf_counter()
        if self._adapter is not None:  # merged before the load, while the old weights still serve
            adapter_tensors = dict(staged.named_tensors())
            merged = await asyncio.to_thread(lambda: dict(self._adapter.merged(self._lora_base, adapter_tensors)))
            staged = MergedVersion(merged, staged)
        blocked_s = await self.engine.load_staged(
            staged, version, self._consume_bytes, swap=self._dual_buffer, interrupt=self._interrupt
        )
        return {"load_s": time.perf_counter() - start, "blocked_s": blocked_s,
                "keeps_buffer": self._dual_buffer and self._adapter is None,
                "interrupted": self.engine.last_load_interrupted}

    def weight_digests(self) -> dict[str, str]:
        """name -> digest of the served weights (bit-identity checks against the trainer)."""
        return {name: tensor_digest(t) for name, t in self.engine.model.state_dict().items()}

    # ------------------------------------------------------------------ memory (no-ops on CPU)

    async def wake_up(self, *args: Any, **kwargs: Any) -> None:
        """No-op: the weights and cache stay in host memory; nothing was offloaded by sleep()."""

    async def sleep(self) -> None:
        """No-op: there is no accelerator memory to hand back to a colocated trainer."""

    async def release_kv_cache(self) -> None:
        """No-op: the KV cache is sized per batch and freed as rows finish; no pool to release."""

    async def resume_kv_cache(self) -> None:
        """No-op counterpart of :meth:`release_kv_cache`."""

    async def clear_kv_cache(self) -> None:
        """Drop the running batch's KV cache; in-flight rows are re-prefilled at the next step.

        There is no prefix cache across requests, so nothing else can hold stale state.
        """
        if self.engine is not None:
            self.engine.clear_kv_cache()

    async def start_profile(self, **kwargs: Any) -> None:
        """No-op: no engine profiler on CPU."""

    async def stop_profile(self) -> None:
        """No-op: no engine profiler on CPU."""


def _eos_ids(model_config: HFModelConfig) -> set[int]:
    """EOS ids from the generation config, the (tokenizer-patched) hf config and the tokenizer."""
    eos: set[int] = set()
    for source in ("generation_config", "hf_config", "tokenizer"):
        value = getattr(getattr(model_config, source, None), "eos_token_id", None)
        if value is not None:
            eos.update([value] if isinstance(value, int) else value)
    return eos
