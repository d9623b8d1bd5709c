"""A user's own agent loop, as a verl user writes one (not part of the project's package): the model
answers, an environment replies (`ENV_REPLY`, tokenized on its own, masked out of the loss), the
model answers again. Registered through `actor_rollout_ref.rollout.agent.agent_loop_config_path`
(`two_turn_loop.yaml` beside it)."""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput

ENV_REPLY = "=="  # what the environment says between the turns (the demo tokenizer's "=" twice)


class TwoTurnAgentLoop(AgentLoopBase):
    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        budget = int(self.rollout_config.response_length)
        prompt_ids = await self.ct_build_initial_tokens(list(kwargs["raw_prompt"]))
        request_id = uuid4().hex  # one trajectory: both turns on one server
        first = await self.server_manager.generate(request_id=request_id, prompt_ids=prompt_ids,
                                                   sampling_params={**sampling_params, "max_tokens": budget // 2})
        env = self.tokenizer.encode(ENV_REPLY, add_special_tokens=False)
        left = budget - len(first.token_ids) - len(env)
        second = await self.server_manager.generate(request_id=request_id,
                                                    prompt_ids=prompt_ids + first.token_ids + env,
                                                    sampling_params={**sampling_params, "max_tokens": max(1, left)})
        response = first.token_ids + env + second.token_ids
        mask = [1] * len(first.token_ids) + [0] * len(env) + [1] * len(second.token_ids)
        log_probs = list(first.log_probs) + [0.0] * len(env) + list(second.log_probs)
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=response[:budget], response_mask=mask[:budget],
                               response_logprobs=log_probs[:budget], num_turns=4, metrics={},
                               extra_fields={"turn_scores": [], "tool_rewards": [],  # verl's trainer reads these
                                             "min_global_steps": first.extra_fields.get("min_global_steps"),
                                             "max_global_steps": second.extra_fields.get("max_global_steps")})
