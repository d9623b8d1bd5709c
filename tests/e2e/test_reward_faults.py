"""A reward function that raises or hangs on some samples: `reward.on_error=stop` (the default)
fails the run naming it (tests/e2e/test_pipeline_e2e.py); `zero` scores those samples 0, counts them in
`async/faults/reward_errors` and trains on."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from async_rl.core.config import read_async_config
from async_rl.core.errors import AsyncConfigError
from async_rl.core.scoring import ResponseToScore, score_each_zeroing_failures
from helpers.rows import every_step_with
from helpers.runs import run_verl

HANG_S = 30.0  # a hung call sleeps this long: far past the timeouts below


def responses(texts):
    return [ResponseToScore(data_source="digits", solution_str=t, ground_truth="12", extra_info=None, length=len(t))
            for t in texts]


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_zero_mode_scores_raising_and_hung_samples_0_and_names_their_rows():
    release, calls = threading.Event(), []

    def score(data_source, solution_str, ground_truth, extra_info=None):
        calls.append(solution_str)
        if solution_str == "boom":
            raise ValueError("bad sample")
        if solution_str == "hang":
            release.wait(HANG_S)
            return 0.75  # arrives after the timeout: must be ignored
        if solution_str == "13":  # the next thread wakes the hung call while the batch is still scored
            release.set()
            time.sleep(0.3)
        return 1.0 if solution_str == ground_truth else 0.5

    async def run():
        return await score_each_zeroing_failures(responses(["12", "boom", "hang", "13", "12"]), score, None, 0.5)

    start = time.monotonic()
    scores, failures = asyncio.run(run())
    release.set()
    assert time.monotonic() - start < HANG_S / 2  # the hung call was given up on, not waited for
    assert scores.tolist() == [1.0, 0.0, 0.0, 0.5, 1.0]
    assert [row for row, _ in failures] == [1, 2]
    assert "ValueError: bad sample" in failures[0][1] and "reward.async_timeout_s=0.5" in failures[1][1]
    # the thread left behind returns from the hung call and stops: no response is scored twice
    left_behind = [t for t in threading.enumerate() if t.name == "reward-from-0"]
    for thread in left_behind:
        thread.join(timeout=5.0)
    assert not any(t.is_alive() for t in left_behind)
    assert sorted(calls) == sorted(["12", "boom", "hang", "13", "12"])


def test_zero_mode_on_a_clean_batch_is_the_plain_scores():
    def score(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": float(len(solution_str))}  # verl's dict form

    scores, failures = asyncio.run(score_each_zeroing_failures(responses(["1", "22", "333"]), score, None, 5.0))
    assert scores.tolist() == [1.0, 2.0, 3.0] and failures == []


def test_reward_on_error_key_is_validated():
    from omegaconf import OmegaConf

    assert read_async_config(OmegaConf.create({})).reward_on_error == "stop"
    assert read_async_config(OmegaConf.create({"reward": {"on_error": "zero"}})).reward_on_error == "zero"
    with pytest.raises(AsyncConfigError, match="reward.on_error"):
        read_async_config(OmegaConf.create({"reward": {"on_error": "skip"}}))


@pytest.mark.slow
def test_zero_mode_trains_through_a_raising_and_a_hanging_reward(demo_dir, tmp_path, ray_address):
    hung = tmp_path / "hung_once"
    flaky_reward = tmp_path / "flaky_reward.py"
    flaky_reward.write_text(
        "import os, time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
        f"    if not os.path.exists({str(hung)!r}):\n"
        f"        open({str(hung)!r}, 'w').close()\n"
        f"        time.sleep({HANG_S})\n"
        "    if solution_str[:1] == ground_truth[:1]:\n"
        "        raise ValueError('reward exploded')\n"
        "    return 0.0\n"
    )
    extra = {"trainer.total_training_steps": 2, "trainer.test_freq": -1, "trainer.val_before_train": False,
             "reward.custom_reward_function.path": str(flaky_reward),
             "+reward.on_error": "zero", "+reward.async_timeout_s": 2}
    code, out, rows = run_verl(demo_dir, extra, tmp_path, timeout_s=400, ray_address=ray_address)
    assert code == 0, out[-4000:]
    assert hung.exists()
    by_step = every_step_with(rows, 2, ["async/faults/reward_errors", "critic/score/mean"])
    # step 1 has the hung call plus every sample whose first digit is right (about 1 in 10 at random)
    assert all(m["async/faults/reward_errors"] >= 1 for m in by_step.values()), by_step
    assert all(m["critic/score/mean"] == 0.0 for m in by_step.values())  # raised and hung samples scored 0
    assert "scored 0" in out


class EchoServer:
    """A rollout server whose every response is the prompt's last 4 tokens (the demo's digits)."""

    class _Generate:
        def remote(self, prompt_ids, sampling_params, request_id):
            from verl.workers.rollout.replica import TokenOutput

            async def out():
                return TokenOutput(token_ids=list(prompt_ids[-4:]), log_probs=[0.0] * 4, stop_reason="completed")
            return out()

    generate = _Generate()


@pytest.mark.parametrize("on_error", ["stop", "zero"])
def test_validation_scores_through_the_same_guard(demo_dir, tmp_path, on_error):
    from transformers import AutoTokenizer

    from async_rl.core.config import strip_async_keys
    from async_rl.core.scoring import RewardFunctionError
    from async_rl.demo import demo_overrides
    from async_rl.validation import Validator
    from async_rl.core.policy_clock import ClockRef
    from async_rl.core.staleness import StalenessGate
    from state_machines.generate import GenerateStage
    from helpers.lineage import compose_ppo

    flaky = tmp_path / "flaky.py"
    flaky.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
                     "    if extra_info['index'] == 3:\n"
                     "        raise ValueError('bad val sample')\n"
                     "    return 1.0\n")
    config = compose_ppo(demo_overrides(demo_dir, extra={"reward.custom_reward_function.path": str(flaky),
                                                         "+actor_rollout_ref.async_pipeline": False}))
    strip_async_keys(config)
    # verl's agent loops on the echo server
    stage = GenerateStage(servers=[EchoServer()], config=config, clock=ClockRef.in_process(StalenessGate(1)))
    validator = Validator(config, AutoTokenizer.from_pretrained(demo_dir / "model"), 5.0, on_error,
                          generate=lambda rows, n, step: stage.run_agent_loops(rows, n, validate=True, step=step))
    if on_error == "stop":
        with pytest.raises(RewardFunctionError, match="validation at step 7: .*sample 3: ValueError: bad val sample"):
            validator.run(timeout_s=30, step=7)
    else:
        rows = len(validator.rows)
        assert validator.run(timeout_s=30, step=7)["val-aux/reward/mean"] == pytest.approx((rows - 1) / rows)
