"""Continuous-batching generation engine for a Hugging Face causal LM on CPU.

One background asyncio task owns the model. Every iteration ("step") it

1. admits waiting requests (FIFO, up to ``max_num_seqs`` live sequences) and
   *prefills* them: one forward over their prompts, left-padded, which also
   yields their first new token;
2. *decodes* every sequence already in the running batch: one forward of the
   last token of each row against the shared KV cache, one new token per row;
3. samples, appends the tokens, and drops rows that finished or were aborted.

So a request submitted while others are decoding joins the running batch at
the next step, and a finished one leaves it at once. Model calls run in a worker
thread (``asyncio.to_thread``), so the event loop keeps serving ``abort_all``,
``pause`` and new requests while a forward is in progress.

The KV cache is one ``transformers.DynamicCache`` for the whole batch, left
padded: rows share the column layout, a 2-D attention mask hides the padding
and ``position_ids`` are given per row, so padding never shifts RoPE positions.
Only models whose layers are all full attention are supported (Qwen2/Qwen3,
Llama, ...); sliding-window or linear-attention layers are rejected at
construction.

Weights: :meth:`ContinuousBatchingEngine.load_staged` (a complete version staged by
param_update: swap of a dual buffer's halves, or a copy) and
:meth:`ContinuousBatchingEngine.update_weights` (full tensors) run between steps
(they take the same lock as a step, so never in the middle of a forward). After
an update the KV cache is dropped and every in-flight sequence is re-prefilled
with the new weights, so each token's log-prob is exactly the one its recorded
version assigns to it given the whole prefix.

Log-probs: for a sampled token ``t`` with temperature ``T > 0`` the engine
returns ``log_softmax(logits / T)[t]`` of the raw model logits: the policy at
temperature ``T``, the same quantity verl's actor computes with
``temperature=T``. top-k / top-p restrict *which* tokens can be sampled but are
not folded into the returned log-prob. Greedy requests (``temperature == 0``)
return ``log_softmax(logits)[t]`` (temperature 1).

Measurement (why a hand-written loop): tiny Qwen2 (vocab 16, hidden 64, 2 layers, float32,
sdpa), 256 requests submitted at once, prompt length 8, 4-16 new tokens each (2,562 tokens),
pure sampling at temperature 1 with log-probs, 2 CPU cores, torch 2.13, transformers 5.10,
4 repetitions: this engine 0.11-0.18 s wall; transformers' ``ContinuousBatchingManager``
(``model.init_continuous_batching``, paged attention, ``return_logprobs=True``, no CUDA
graphs) 0.72-0.87 s. transformers' manager also fixes ``do_sample`` per manager rather than
per request, returns log-probs after top-k/top-p filtering, and decodes in its own thread
with no step boundary at which weights could be swapped safely.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

logger = logging.getLogger(__name__)

STOP_COMPLETED = "completed"
STOP_ABORTED = "aborted"
STOP_LENGTH = "length"

# Sampling-param keys that are accepted and have no effect here (detokenization options; log-probs are always on).
_NO_EFFECT_KEYS = frozenset({"logprobs", "skip_special_tokens", "spaces_between_special_tokens", "detokenize"})
# Keys this engine cannot honour unless they hold their neutral value (key -> neutral value).
_UNSUPPORTED_NEUTRAL = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_p": 0.0,
    "n": 1,
}
_warned_keys: set[str] = set()  # unknown sampling keys already warned about (warn once per key)


@dataclass(frozen=True)
class SamplingOptions:
    """Per-request sampling settings.

    ``temperature`` 0 means greedy; ``top_k`` <= 0 and ``top_p`` >= 1 disable the
    filters; ``max_new_tokens`` counts generated tokens; generation also stops after
    any of ``stop_token_ids`` (the token is kept in the output).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @classmethod
    def from_params(cls, params: Optional[Mapping[str, Any]], default_max_new_tokens: int = 16) -> SamplingOptions:
        """Build from a vLLM/SGLang-style dict (``max_new_tokens`` or ``max_tokens``).

        Raises ValueError for settings this engine cannot honour (e.g. ``repetition_penalty != 1``);
        unknown keys are ignored with a warning.
        """
        params = dict(params or {})
        max_new = params.pop("max_new_tokens", None)
        max_tokens = params.pop("max_tokens", None)
        if max_new is None:
            max_new = max_tokens if max_tokens is not None else default_max_new_tokens
        stop = set(params.pop("stop_token_ids", None) or ())
        opts = cls(
            temperature=float(params.pop("temperature", 1.0)),
            top_p=float(params.pop("top_p", 1.0)),
            top_k=int(-1 if (top_k := params.pop("top_k", None)) is None else top_k),
            max_new_tokens=max(0, int(max_new)),
            stop_token_ids=frozenset(int(t) for t in stop),
            ignore_eos=bool(params.pop("ignore_eos", False)),
        )
        if opts.temperature < 0 or not math.isfinite(opts.temperature):
            raise ValueError(f"temperature must be >= 0, got {opts.temperature}")
        if not 0.0 < opts.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {opts.top_p}")
        for key, neutral in _UNSUPPORTED_NEUTRAL.items():
            value = params.pop(key, None)
            if value is not None and float(value) != neutral:
                raise ValueError(f"sampling param {key}={value} is not supported by the CPU engine")
        for key in set(params) - _NO_EFFECT_KEYS - _warned_keys:
            _warned_keys.add(key)
            logger.warning("CPU engine ignores sampling param %r (e.g. %r)", key, params[key])
        return opts


@dataclass
class GenerationResult:
    """Output of one request.

    ``log_probs[i]`` is ``log_softmax(logits / T)[token_ids[i]]`` (``T = 1`` for greedy);
    ``token_versions[i]`` is the weight version that produced ``token_ids[i]``;
    ``stop_reason`` is "completed" (eos/stop token), "length" (``max_new_tokens`` or
    ``max_model_len`` reached) or "aborted".
    """

    request_id: str
    token_ids: list[int]
    log_probs: list[float]
    token_versions: list[int]
    stop_reason: str


@dataclass(eq=False)
class _Sequence:
    request_id: str
    prompt_ids: list[int]
    opts: SamplingOptions
    future: asyncio.Future
    max_len: int  # total (prompt + generated) length at which generation stops
    out_ids: list[int] = field(default_factory=list)
    out_logps: list[float] = field(default_factory=list)
    out_versions: list[int] = field(default_factory=list)
    done: bool = False

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.out_ids

    def result(self, stop_reason: str) -> GenerationResult:
        return GenerationResult(
            request_id=self.request_id,
            token_ids=list(self.out_ids),
            log_probs=list(self.out_logps),
            token_versions=list(self.out_versions),
            stop_reason=stop_reason,
        )


class _KVBatch:
    """Rows of the running batch: sequences, their left-padded KV cache and attention mask.

    Invariant: the cache holds every token of each row except the last one in ``seq.all_ids``,
    which is the next decode step's input. ``mask`` is ``[rows, cache_len]`` (1 = real token).
    """

    def __init__(self, seqs: list[_Sequence], cache: Optional[DynamicCache], mask: torch.Tensor):
        self.seqs = seqs
        self.cache = cache
        self.mask = mask

    @classmethod
    def empty(cls) -> _KVBatch:
        return cls([], None, torch.zeros(0, 0, dtype=torch.long))

    def __len__(self) -> int:
        return len(self.seqs)

    def _layers(self):
        return self.cache.layers if self.cache is not None else []

    def select(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order) and drop leading all-padding columns."""
        if not rows:
            self.seqs, self.cache, self.mask = [], None, torch.zeros(0, 0, dtype=torch.long)
            return
        index = torch.tensor(rows, dtype=torch.long)
        self.seqs = [self.seqs[i] for i in rows]
        self.mask = self.mask[index]
        used = self.mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else self.mask.shape[1]
        self.mask = self.mask[:, start:]
        for layer in self._layers():
            layer.keys = layer.keys[index, :, start:]
            layer.values = layer.values[index, :, start:]

    def extend(self, other: _KVBatch) -> None:
        """Append ``other``'s rows, left-padding whichever cache is shorter."""
        if len(other) == 0:
            return
        if len(self) == 0:
            self.seqs, self.cache, self.mask = other.seqs, other.cache, other.mask
            return
        width = max(self.mask.shape[1], other.mask.shape[1])

        def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - t.shape[dim]
            if missing == 0:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        for mine, theirs in zip(self._layers(), other._layers(), strict=True):
            mine.keys = torch.cat([pad(mine.keys, 2), pad(theirs.keys, 2)], dim=0)
            mine.values = torch.cat([pad(mine.values, 2), pad(theirs.values, 2)], dim=0)
        self.mask = torch.cat([pad(self.mask, 1), pad(other.mask, 1)], dim=0)
        self.seqs = self.seqs + other.seqs


def _sample(
    logits: torch.Tensor, opts: list[SamplingOptions], generator: torch.Generator
) -> tuple[list[int], list[float]]:
    """Sample one token per row of ``logits`` ``[rows, vocab]``; return tokens and their log-probs."""
    temps = torch.tensor([o.temperature if o.temperature > 0 else 1.0 for o in opts], dtype=logits.dtype)
    scaled = logits / temps[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)

    filtered = scaled
    vocab = logits.shape[-1]
    top_ks = [o.top_k if 0 < o.top_k < vocab else vocab for o in opts]
    if any(k < vocab for k in top_ks):
        k = torch.tensor(top_ks)
        kth = torch.sort(filtered, dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if any(o.top_p < 1.0 for o in opts):
        top_p = torch.tensor([o.top_p for o in opts], dtype=logits.dtype)
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))

    sampled = torch.multinomial(torch.softmax(filtered, dim=-1), 1, generator=generator).squeeze(-1)
    greedy = torch.tensor([o.greedy for o in opts])
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    token_logprobs = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens.tolist(), token_logprobs.tolist()


class ContinuousBatchingEngine:
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
        self._generator = torch.Generator().manual_seed(seed)
        self._version = version

        self._requests: dict[str, _Sequence] = {}  # every live request: waiting, prefilling or in the batch
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._batch = _KVBatch.empty()
        self._cache_stale = False  # re-prefill every live row at the next step
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
        """Load ``path`` with ``AutoModelForCausalLM`` in float32 with sdpa attention."""
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        return cls(model, **kwargs)

    # ------------------------------------------------------------------ public API

    @property
    def param_version(self) -> int:
        """Weight version used for the next generated token."""
        return self._version

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def num_running(self) -> int:
        """Live requests (waiting + decoding)."""
        return len(self._requests)

    def num_tokens(self, request_id: str) -> Optional[int]:
        """Tokens generated so far by a live request; None if it is not live."""
        seq = self._requests.get(request_id)
        return None if seq is None else len(seq.out_ids)

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: Optional[Mapping[str, Any]] = None,
        request_id: Optional[str] = None,
    ) -> GenerationResult:
        """Generate a continuation of ``prompt_ids``; returns when it stops or is aborted.

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
        opts = SamplingOptions.from_params(sampling_params)
        max_len = min(self.max_model_len, len(prompt_ids) + opts.max_new_tokens)
        if max_len <= len(prompt_ids):
            return GenerationResult(request_id, [], [], [], STOP_LENGTH)

        seq = _Sequence(request_id, prompt_ids, opts, asyncio.get_running_loop().create_future(), max_len)
        self._requests[request_id] = seq
        self._waiting.append(seq)
        self._wakeup.set()
        try:
            return await seq.future
        except asyncio.CancelledError:
            self._finish(seq, None)  # caller gave up: free the slot
            raise

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
        from param_update.staging import weight_layout

        return weight_layout(self.model.state_dict(keep_vars=True))

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
        _, _, tensors = self.weight_layout()
        start = time.perf_counter()
        try:
            if not interrupt:
                await self._wait_for_running()
            async with self._step_lock:
                locked = time.perf_counter()
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

    def _live_rows(self) -> int:
        return sum(not s.done for s in self._batch.seqs)

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

    def _finish(self, seq: _Sequence, stop_reason: Optional[str]) -> None:
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
                    self._batch = _KVBatch.empty()  # only aborted rows left: free their cache now
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            async with self._step_lock:
                if self._paused:
                    continue
                try:
                    await self._step()
                except Exception as error:  # a bug here must not leave callers waiting forever
                    logger.exception("CPU engine step failed")
                    self._fail_all(error)

    def _fail_all(self, error: Exception) -> None:
        for seq in list(self._requests.values()):
            seq.done = True
            if not seq.future.done():
                seq.future.set_exception(error)
        self._requests.clear()
        self._waiting.clear()
        self._batch = _KVBatch.empty()

    async def _step(self) -> None:
        batch = self._batch
        if self._cache_stale:
            prefill = [s for s in batch.seqs if not s.done]
            batch = _KVBatch.empty()
            self._cache_stale = False
        else:
            prefill = []
        while self._admitting and self._waiting and len(batch) + len(prefill) < self.max_num_seqs:
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
            self._batch = _KVBatch.empty()
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
    def _forward(self, batch: _KVBatch, prefill: list[_Sequence]) -> tuple[_KVBatch, list[int], list[float]]:
        """Decode one token for ``batch`` rows and prefill ``prefill``; return the merged batch
        (rows: decoded first, then prefilled) with one sampled token and log-prob per row."""
        logits = []
        live = [i for i, s in enumerate(batch.seqs) if not s.done]
        if len(live) < len(batch):  # drop rows aborted since the last step
            batch.select(live)
        if len(batch):
            logits.append(self._decode(batch))
        start = 0
        while start < len(prefill):  # chunks of at most max_prefill_tokens padded tokens
            end, longest = start, 0
            while end < len(prefill):
                longest_next = max(longest, len(prefill[end].all_ids))
                if end > start and longest_next * (end - start + 1) > self.max_prefill_tokens:
                    break
                longest, end = longest_next, end + 1
            chunk, chunk_logits = self._prefill(prefill[start:end])
            batch.extend(chunk)
            logits.append(chunk_logits)
            start = end
        if not logits:
            return batch, [], []
        tokens, logps = _sample(torch.cat(logits), [s.opts for s in batch.seqs], self._generator)
        return batch, tokens, logps

    def _decode(self, batch: _KVBatch) -> torch.Tensor:
        rows = len(batch)
        input_ids = torch.tensor([[s.all_ids[-1]] for s in batch.seqs], dtype=torch.long)
        positions = torch.tensor([[len(s.prompt_ids) + len(s.out_ids) - 1] for s in batch.seqs], dtype=torch.long)
        mask = torch.cat([batch.mask, torch.ones(rows, 1, dtype=torch.long)], dim=1)
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=batch.cache,
            use_cache=True,
        )
        batch.mask = mask
        return out.logits[:, -1].float()

    def _prefill(self, seqs: list[_Sequence]) -> tuple[_KVBatch, torch.Tensor]:
        """Forward the full token lists of ``seqs`` (left-padded) and return their cache and next-token logits.

        Once the sampled token is appended, the cache holds every token but the last (the batch invariant).
        """
        ids = [s.all_ids for s in seqs]
        width = max(len(x) for x in ids)
        input_ids = torch.zeros(len(ids), width, dtype=torch.long)
        mask = torch.zeros(len(ids), width, dtype=torch.long)
        positions = torch.zeros(len(ids), width, dtype=torch.long)
        for row, x in enumerate(ids):
            input_ids[row, width - len(x) :] = torch.tensor(x)
            mask[row, width - len(x) :] = 1
            positions[row, width - len(x) :] = torch.arange(len(x))
        cache = DynamicCache()
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        # Zero the padded slots: a padded query attends to nothing, and NaN/garbage computed there must
        # not reach later products (a masked weight of 0 times NaN is still NaN).
        pad = (mask == 0)[:, None, :, None]
        for layer in cache.layers:
            layer.keys = layer.keys.masked_fill(pad, 0.0)
            layer.values = layer.values.masked_fill(pad, 0.0)
        return _KVBatch(list(seqs), cache, mask), out.logits[:, -1].float()


def _copy_into(params: dict[str, torch.Tensor], updates: list[tuple[str, torch.Tensor]]) -> None:
    # new private storage, not an in-place copy: swapped-in weights may be read-only object-store views
    with torch.no_grad():
        for name, tensor in updates:
            params[name].data = tensor.detach().to(device="cpu", dtype=params[name].dtype).clone()


def _default_eos(model: PreTrainedModel) -> set[int]:
    eos: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        eos.update([value] if isinstance(value, int) else value)
    return eos

