"""Requests to the rollout replicas through verl's server interface (`generate` on a replica's
server handle), so the CPU backend, sglang and vllm are interchangeable: one request, and one
response assembled across the aborts of weight loads and the loss of a server."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Optional

from async_rl.core.errors import is_lost_server_error
from async_rl.rollout.supervisor import REQUEST_TIMEOUT_KEY, ReplicaSupervisor


async def generate_one(server, prompt_ids: list[int], sampling_params: dict, timeout_s: float,
                       image_data: Optional[list] = None):
    """One request through verl's server interface (`image_data`: the prompt's images); returns its TokenOutput."""
    request_id = uuid.uuid4().hex
    images = {"image_data": image_data} if image_data else {}
    ref = server.generate.remote(prompt_ids=prompt_ids, sampling_params=dict(sampling_params), request_id=request_id,
                                 **images)
    return await asyncio.wait_for(ref, timeout=timeout_s)


@dataclass
class Response:
    """A response assembled from one or more segments (a segment ends when a weight load aborts it)."""

    token_ids: list[int]
    log_probs: list[float]
    token_versions: list[int]
    segments: int
    stop_reason: str = "completed"  # the last segment's ("length" when the token budget is used up)


async def generate_resumable(
    servers: ReplicaSupervisor, preferred: int, prompt_ids: list[int], sampling_params: dict, timeout_s: float,
    served_version: int, max_segments: int = 64, image_data: Optional[list] = None,
) -> Response:
    """Generate on replica `preferred` (or a surviving one), resubmitting prompt + tokens so far
    whenever a segment ends early: the server aborted the request (verl's GPU servers abort
    in-flight requests around a weight load) or the server was lost (its process gone, or no
    answer within `timeout_s`, s; `servers` restarts it and the request goes to a survivor).
    Tokens, behaviour log-probs and the version of each token are kept; the resubmission gets
    the remaining token budget and its KV cache is recomputed under the served weights (with the prompt's
    images, `image_data`, each time)."""
    budget = int(sampling_params["max_tokens"])
    tokens: list[int] = []
    log_probs: list[float] = []
    versions: list[int] = []
    segment = 0
    while segment < max_segments:
        index, server = await servers.acquire(preferred)
        params = {**sampling_params, "max_tokens": budget - len(tokens)}
        try:
            with servers.serving(index) as periods:
                out = await generate_one(server, list(prompt_ids) + tokens, params, timeout_s, image_data)
                if out.stop_reason == "aborted":
                    periods.note("interrupted")  # by a weight load
        except Exception as exc:  # noqa: BLE001 - only a lost server is survived
            hung = isinstance(exc, asyncio.TimeoutError)
            if not hung and not is_lost_server_error(exc):
                raise
            cause = (f"no answer to a request within {timeout_s:g} s ({REQUEST_TIMEOUT_KEY})" if hung
                     else f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            servers.lost(index, server, cause, hung=hung)
            servers.requests_resubmitted += 1
            continue
        segment += 1
        fields = out.extra_fields or {}
        tokens += list(out.token_ids)
        log_probs += list(out.log_probs or [0.0] * len(out.token_ids))
        version = fields.get("global_steps", served_version)
        versions += list(fields.get("token_versions") or [version if version is not None else served_version]
                         * len(out.token_ids))
        if out.stop_reason != "aborted" or len(tokens) >= budget:
            stop = "length" if len(tokens) >= budget else (out.stop_reason or "completed")
            return Response(tokens, log_probs, versions, segment, stop)
    raise RuntimeError(f"request aborted {max_segments} times in a row; the rollout server keeps aborting it")
