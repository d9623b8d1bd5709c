"""Continuous-batching generation engine for a Hugging Face causal LM on CPU.

One background asyncio task owns the model. Every iteration ("step") it

1. admits waiting requests (FIFO, up to ``max_num_seqs`` live sequences; with an admission window, once
   the oldest has waited the window) and *prefills* them: one forward over their prompts, left-padded, which also
   yields their first new token;
2. *decodes* every sequence already in the running batch: one forward of the
   last token of each row against the shared KV cache, one new token per row;
3. samples, appends the tokens, and drops rows that finished or were aborted.

So a request submitted while others are decoding joins the running batch at
the next step, and a finished one leaves it at once. Model calls run in a worker
thread (``asyncio.to_thread``), so the event loop keeps serving ``abort_all``,
``pause`` and new requests while a forward is in progress.

The batch's KV cache and its forwards: ``kv_batch``; sampling and the log-probs returned:
``sampling``; a request's state and result: ``requests``; weight updates between steps:
``weight_swap``. Why a loop of its own rather than transformers' continuous batching:
bench/README.md#the-cpu-engine-against-transformers-continuous-batching.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import uuid
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch
from transformers import AutoConfig, PreTrainedModel

from async_rl.core.model_class import auto_model_class
from async_rl.rollout.cpu.kv_batch import KVBatch, decode_forward, prefill_forward
from async_rl.rollout.cpu.prompt_logprobs import prompt_logprobs
from async_rl.rollout.cpu.requests import STOP_ABORTED, STOP_COMPLETED, STOP_LENGTH, GenerationResult, SequenceState
from async_rl.rollout.cpu.sampling import SamplingOptions, sample_tokens
from async_rl.rollout.cpu.vision import MultimodalRope
from async_rl.rollout.cpu.weight_swap import WeightSwap

logger = logging.getLogger(__name__)


class ContinuousBatchingEngine(WeightSwap):
    """Serve ``model`` with continuous batching; see the module docstring.

    Args:
        model: causal LM (kept in float32 on CPU, put in eval mode).
        eos_token_ids: tokens that end a request (unless ``ignore_eos``); default: the model's
            ``generation_config``/``config`` eos ids.
        seed: seed of the sampling generator. Sampling is reproducible for the same
            sequence of submissions and batch compositions, not per request.
        max_num_seqs: most sequences decoded together; the rest wait in FIFO order.
        max_model_len: longest prompt + response in tokens; default: ``max_position_embeddings``.
        max_prefill_tokens: padded tokens per prefill forward (rows x longest row); a larger
            prefill is split into several forwards.
        version: initial weight version.
        admission_window_s: how long (s) the oldest waiting request waits for others before the waiting
            requests are admitted together (sooner when they fill ``max_num_seqs``); rows already decoding go
            on meanwhile. 0: every step admits whatever waits.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_ids: Optional[Iterable[int]] = None,
        seed: int = 0,
        max_num_seqs: int = 256,
        max_model_len: Optional[int] = None,
        max_prefill_tokens: int = 8192,
        version: int = 0,
        admission_window_s: float = 0.0,
    ):
        text_config = model.config.get_text_config(decoder=True)
        layer_types = getattr(text_config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise NotImplementedError(
                f"CPU engine supports full-attention models only, got layer types {sorted(set(layer_types))}"
            )
        self.model = model.to(device="cpu", dtype=torch.float32).eval()
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.eos_token_ids = frozenset(_default_eos(model) if eos_token_ids is None else eos_token_ids)
        position_limit = getattr(text_config, "max_position_embeddings", None)
        self.max_model_len = int(max_model_len or position_limit or 2048)
        if position_limit is not None and self.max_model_len > position_limit:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds max_position_embeddings {position_limit}")
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        if not admission_window_s >= 0:
            raise ValueError(f"admission_window_s must be 0 or more, got {admission_window_s}")
        self.admission_window_s = float(admission_window_s)
        self.rope = MultimodalRope.for_model(self.model)  # None: a text-only model
        self._generator = torch.Generator().manual_seed(seed)
        self._version = version

        self._requests: dict[str, SequenceState] = {}  # every live request: waiting, prefilling or in the batch
        self._waiting: collections.deque[SequenceState] = collections.deque()
        self._batch = KVBatch.empty()
        self._cache_stale = False  # re-prefill every live row at the next step
        self.last_load_interrupted = 0  # requests decoding when the last load swapped the weights under them
        self._paused = False
        self._admitting = True  # False while a load waits for the running requests (partial_rollout=False)
        self._drained: Optional[asyncio.Event] = None  # set when no admitted request is left
        self._closed = False
        self._wakeup: Optional[asyncio.Event] = None
        self._step_lock: Optional[asyncio.Lock] = None  # held for a whole step and for weight updates
        self._loop_task: Optional[asyncio.Task] = None
        self.num_steps = 0  # forward steps run so far
        self.num_generated_tokens = 0

    @classmethod
    def from_pretrained(cls, path: str, **kwargs) -> ContinuousBatchingEngine:
        """Load ``path`` in float32 with sdpa attention: ``AutoModelForImageTextToText`` for a model with a
        vision tower, else ``AutoModelForCausalLM``."""
        model = auto_model_class(AutoConfig.from_pretrained(path)).from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa")
        return cls(model, **kwargs)

    # ------------------------------------------------------------------ public API

    @property
    def param_version(self) -> int:
        """Weight version used for the next generated token."""
        return self._version

    @property
    def paused(self) -> bool:
        return self._paused

    def num_tokens(self, request_id: str) -> Optional[int]:
        """Tokens generated so far by a live request; None if it is not live."""
        seq = self._requests.get(request_id)
        return None if seq is None else len(seq.out_ids)

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: Optional[Mapping[str, Any]] = None,
        request_id: Optional[str] = None,
        vision_inputs: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> GenerationResult:
        """Generate a continuation of ``prompt_ids``; returns when it stops or is aborted.
        ``vision_inputs``: the processor's outputs for the prompt's images (``pixel_values``,
        ``image_grid_thw``), whose tokens the prompt holds expanded; a model with multimodal RoPE only.

        ``sampling_params``: ``temperature``, ``top_p``, ``top_k``, ``max_new_tokens`` (or
        ``max_tokens``), ``stop_token_ids``, ``ignore_eos``; ``logprobs`` is ignored (log-probs are
        always returned). Raises ValueError for an empty/too long prompt, out-of-vocab ids or a duplicate live id.
        """
        self._ensure_started()
        prompt_ids = [int(t) for t in prompt_ids]
        request_id = request_id or uuid.uuid4().hex
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt length {len(prompt_ids)} leaves no room below max_model_len {self.max_model_len}")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise ValueError(
                f"prompt token ids must be in [0, {self.vocab_size}), got {min(prompt_ids)}..{max(prompt_ids)}"
            )
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        if vision_inputs is not None:
            if self.rope is None:
                raise ValueError("images given to a model without a vision tower (or without multimodal RoPE)")
            self.rope.check(prompt_ids, vision_inputs)
            vision_inputs = dict(vision_inputs)
        opts = SamplingOptions.from_params(sampling_params)
        max_len = min(self.max_model_len, len(prompt_ids) + opts.max_new_tokens)
        if max_len <= len(prompt_ids):
            return GenerationResult(request_id, [], [], [], STOP_LENGTH)

        loop = asyncio.get_running_loop()
        seq = SequenceState(request_id, prompt_ids, opts, loop.create_future(), max_len, vision_inputs=vision_inputs,
                            arrived_s=loop.time())
        self._requests[request_id] = seq
        self._waiting.append(seq)
        self._wakeup.set()
        try:
            return await seq.future
        except asyncio.CancelledError:
            self._finish(seq, None)  # caller gave up: free the slot
            raise

    async def prompt_logprobs(self, token_ids: list[int], top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's prompt log-probs of `token_ids` under the weights served now (async_rl/rollout/cpu/
        prompt_logprobs.py), computed between decoding steps so that no weight load changes them midway."""
        self._ensure_started()
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {min(token_ids)}..{max(token_ids)}")
        async with self._step_lock:
            return await asyncio.to_thread(prompt_logprobs, self.model, token_ids, top_k)

    def abort(self, request_id: str) -> bool:
        """Abort one request (it returns its tokens so far, "aborted"). False if it is not live."""
        seq = self._requests.get(request_id)
        if seq is None:
            return False
        self._finish(seq, STOP_ABORTED)
        return True

    def abort_all(self) -> list[str]:
        """Abort every live request at once; each returns its tokens so far with "aborted".

        Returns the aborted request ids. Requests submitted afterwards run normally (or wait, if paused).
        """
        aborted = list(self._requests)
        for seq in list(self._requests.values()):
            self._finish(seq, STOP_ABORTED)
        return aborted

    async def pause(self) -> None:
        """Stop decoding; returns once no step is in progress. New requests wait until :meth:`resume`."""
        self._ensure_started()
        self._paused = True
        async with self._step_lock:
            pass

    def resume(self) -> None:
        """Continue decoding after :meth:`pause` (waiting and in-flight requests proceed)."""
        self._paused = False
        if self._wakeup is not None:
            self._wakeup.set()

    def clear_kv_cache(self) -> None:
        """Drop the KV cache; in-flight rows are re-prefilled at the next step."""
        self._cache_stale = True

    def _live_rows(self) -> int:
        return sum(not s.done for s in self._batch.seqs)

    async def close(self) -> None:
        """Abort everything and stop the background loop."""
        self._closed = True
        self.abort_all()
        if self._loop_task is not None:
            self._wakeup.set()
            self._loop_task.cancel()
            try:
                await asyncio.wait_for(self._loop_task, timeout=30)
            except (asyncio.CancelledError, asyncio.TimeoutError):
                pass
            self._loop_task = None

    # ------------------------------------------------------------------ loop

    def _ensure_started(self) -> None:
        if self._closed:
            raise RuntimeError("engine is closed")
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._drained = asyncio.Event()
            self._step_lock = asyncio.Lock()
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="cpu-engine-loop")

    def _finish(self, seq: SequenceState, stop_reason: Optional[str]) -> None:
        """Resolve ``seq`` (no-op if already done); its row is dropped at the next compaction."""
        if seq.done:
            return
        seq.done = True
        self._requests.pop(seq.request_id, None)
        if stop_reason is not None and not seq.future.done():
            seq.future.set_result(seq.result(stop_reason))

    async def _run(self) -> None:
        while not self._closed:
            if not self._live_rows():
                self._drained.set()
            idle = not self._requests or (not self._admitting and not self._live_rows())
            if self._paused or idle:
                if not self._requests:
                    self._batch = KVBatch.empty()  # only aborted rows left: free their cache now
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            wait_s = self._admission_wait_s()
            if wait_s > 0:  # nothing decodes: the waiting requests wait for more to join them
                self._wakeup.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), wait_s)
                continue
            async with self._step_lock:
                if self._paused:
                    continue
                try:
                    await self._step()
                except Exception as error:  # a bug here must not leave callers waiting forever
                    logger.exception("CPU engine step failed")
                    self._fail_all(error)

    def _admission_due_in_s(self) -> float:
        """Seconds until the waiting requests are admitted: 0 once the oldest has waited the admission window,
        or when they fill the batch."""
        if not self._waiting or len(self._waiting) + len(self._batch) >= self.max_num_seqs:
            return 0.0
        waited_s = asyncio.get_running_loop().time() - self._waiting[0].arrived_s
        return max(0.0, self.admission_window_s - waited_s)

    def _admission_wait_s(self) -> float:
        """Seconds the loop sleeps before its next step: the admission's wait when no row decodes, else 0."""
        return 0.0 if self._live_rows() else self._admission_due_in_s()

    def _fail_all(self, error: Exception) -> None:
        for seq in list(self._requests.values()):
            seq.done = True
            if not seq.future.done():
                seq.future.set_exception(error)
        self._requests.clear()
        self._waiting.clear()
        self._batch = KVBatch.empty()

    async def _step(self) -> None:
        batch = self._batch
        if self._cache_stale:
            prefill = [s for s in batch.seqs if not s.done]
            batch = KVBatch.empty()
            self._cache_stale = False
        else:
            prefill = []
        admit = self._admitting and self._admission_due_in_s() == 0
        while admit and self._waiting and len(batch) + len(prefill) < self.max_num_seqs:
            seq = self._waiting.popleft()
            if not seq.done:
                prefill.append(seq)
        version = self._version
        try:
            batch, tokens, logps = await asyncio.to_thread(self._forward, batch, prefill)
        except Exception as error:  # fail the rows of this step, keep serving
            logger.exception("CPU engine step failed")
            for seq in batch.seqs + prefill:
                if not seq.done:
                    seq.done = True
                    self._requests.pop(seq.request_id, None)
                    if not seq.future.done():
                        seq.future.set_exception(error)
            self._batch = KVBatch.empty()
            return
        self.num_steps += 1

        keep = []
        for row, (seq, token, logp) in enumerate(zip(batch.seqs, tokens, logps, strict=True)):
            if seq.done:  # aborted while the forward ran
                continue
            seq.out_ids.append(token)
            seq.out_logps.append(logp)
            seq.out_versions.append(version)
            self.num_generated_tokens += 1
            if token in seq.opts.stop_token_ids or (token in self.eos_token_ids and not seq.opts.ignore_eos):
                self._finish(seq, STOP_COMPLETED)
            elif len(seq.prompt_ids) + len(seq.out_ids) >= seq.max_len:
                self._finish(seq, STOP_LENGTH)
            else:
                keep.append(row)
        # rows aborted after this point are dropped at the next step's compaction
        if len(keep) < len(batch):
            await asyncio.to_thread(batch.select, keep)
        self._batch = batch

    @torch.no_grad()
    def _forward(self, batch: KVBatch, prefill: list[SequenceState]) -> tuple[KVBatch, list[int], list[float]]:
        """Decode one token for ``batch`` rows and prefill ``prefill``; return the merged batch
        (rows: decoded first, then prefilled) with one sampled token and log-prob per row."""
        logits = []
        live = [i for i, s in enumerate(batch.seqs) if not s.done]
        if len(live) < len(batch):  # drop rows aborted since the last step
            batch.select(live)
        if len(batch):
            logits.append(decode_forward(self.model, batch, self.rope))
        start = 0
        while start < len(prefill):  # chunks of at most max_prefill_tokens padded tokens
            end, longest = start, 0
            while end < len(prefill):
                longest_next = max(longest, len(prefill[end].all_ids))
                if end > start and longest_next * (end - start + 1) > self.max_prefill_tokens:
                    break
                longest, end = longest_next, end + 1
            chunk, chunk_logits = prefill_forward(self.model, prefill[start:end], self.rope)
            batch.extend(chunk)
            logits.append(chunk_logits)
            start = end
        if not logits:
            return batch, [], []
        tokens, logps = sample_tokens(torch.cat(logits), [s.opts for s in batch.seqs], self._generator)
        return batch, tokens, logps


def _default_eos(model: PreTrainedModel) -> set[int]:
    eos: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        eos.update([value] if isinstance(value, int) else value)
    return eos

