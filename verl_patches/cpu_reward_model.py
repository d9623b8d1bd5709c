"""One patch: verl 0.9.1's reward loop scores a discriminative reward model served by the CPU backend.

`RewardLoopWorker.compute_score_disrm` (verl/experimental/reward_loop/reward_loop.py) picks the
request by `reward.reward_model.rollout.name` and raises `NotImplementedError` for any name but
vllm / sglang / trtllm. The CPU backend's reward server answers vLLM's `/classify`
(async_rl/rollout/cpu/reward_server.py), so for `rollout.name=cpu` the patch sends vLLM's request
(`use_activation=False`: the raw score) and reads vLLM's answer (`data[-1].probs[-1]`); every other
name goes to verl's method unchanged. Applied where verl's reward loop runs on a CPU run: verl's own
trainer's workers (`async_rl/verl_trainer_on_cpu.py`) and the pipeline's reward scoring. Tested in
tests/rollout/test_cpu_reward_model.py (verl's method alone raises NotImplementedError).
"""

from __future__ import annotations

import functools

CPU_BACKEND = "cpu"
_MARK = "_async_rl_cpu_reward_model"


def patch_disrm_on_cpu() -> None:
    """Install the patch (idempotent)."""
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    original = RewardLoopWorker.compute_score_disrm
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    async def compute_score_disrm(self, data):
        if str(self.config.reward.reward_model.rollout.name) != CPU_BACKEND:
            return await original(self, data)
        prompt = await self._preprocess_reward_inputs(data)
        payload = {"model": self.config.reward.reward_model.model_path, "input": prompt, "use_activation": False}
        output = await self._post_request(payload, "classify")
        return {"reward_score": output["data"][-1]["probs"][-1]}

    setattr(compute_score_disrm, _MARK, True)
    RewardLoopWorker.compute_score_disrm = compute_score_disrm
