"""A user's agent loop whose second turn does not extend the first (it drops the first answer, as a
loop that summarises its context would); registered by a test through `agent_loop_config_path`."""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput


class SummarisingAgentLoop(AgentLoopBase):
    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        prompt_ids = await self.ct_build_initial_tokens(list(kwargs["raw_prompt"]))
        request_id = uuid4().hex
        first = await self.server_manager.generate(request_id=request_id, prompt_ids=prompt_ids,
                                                   sampling_params={**sampling_params, "max_tokens": 2})
        summary = prompt_ids[-1:]  # the context, cut to its last token
        second = await self.server_manager.generate(request_id=request_id, prompt_ids=summary,
                                                    sampling_params={**sampling_params, "max_tokens": 2})
        response = first.token_ids + second.token_ids
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=response, response_mask=[1] * len(response),
                               response_logprobs=first.log_probs + second.log_probs, num_turns=3, metrics={})
