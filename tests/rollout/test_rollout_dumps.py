"""verl's `skip.rollout` under the flag (async_rl/rollout/rollout_dumps.py), without Ray: the generate stage
dumps a listed step's agent-loop output in verl's layout and a later stage replays it without a request;
unlisted steps and validation are generated; bad values are refused at start naming the section."""

from __future__ import annotations

import asyncio

import pytest

from async_rl.core.errors import AsyncConfigError
from async_rl.core.messages import PromptBatch
from async_rl.core.policy_clock import ClockRef
from async_rl.core.staleness import StalenessGate
from async_rl.rollout.rollout_dumps import RolloutDumps
from helpers.lineage import compose_ppo
from helpers.scripted_server import ScriptedServer
from state_machines.generate import GenerateStage

ROWS = [{"raw_prompt": [{"role": "user", "content": f"copy {d}"}], "data_source": "d", "index": i,
         "reward_model": {"ground_truth": d}} for i, d in enumerate(("123", "4567"))]


def skip_config(demo_dir, dump_dir, steps="[1,3]", action="cache"):
    from async_rl.core.config import strip_async_keys
    from async_rl.demo import demo_overrides

    extra = ["actor_rollout_ref.rollout.n=2", "skip.rollout.enable=true", f"skip.rollout.dump_dir={dump_dir}",
             f"skip.rollout.steps={steps}", f"skip.rollout.action={action}"]
    config = compose_ppo(demo_overrides(demo_dir, extra=extra))
    strip_async_keys(config)
    return config


def answering(tokens: list[int], version: int) -> ScriptedServer:
    return ScriptedServer(lambda kwargs, calls: (tokens, version, "completed"))


def generate(stage: GenerateStage, index: int):
    return asyncio.run(asyncio.wait_for(stage.process_data(PromptBatch(index, ROWS)), 60))


def test_a_listed_step_is_dumped_in_verls_layout_and_replayed_without_a_request(demo_dir, tmp_path):
    config = skip_config(demo_dir, tmp_path / "dumps")
    first = answering([7, 13, 3], version=4)
    dumped = generate(GenerateStage(servers=[first], config=config, clock=ClockRef.in_process(StalenessGate(2))), 0)
    assert len(first.calls) == 4  # 2 prompts x n=2, generated: step 1 had no dump yet
    # verl's RolloutSkip layout: {experiment}_{project}/GBS{batch}_N{n}_in{prompt}_out{response}/{step}/gen_batch.dp
    trainer = config.trainer
    run_dir = tmp_path / "dumps" / f"{trainer.experiment_name}_{trainer.project_name}" / (
        f"GBS{config.data.train_batch_size}_N2_in{config.data.max_prompt_length}_out{config.data.max_response_length}")
    assert sorted(p.name for p in (run_dir / "1").iterdir()) == ["gen_batch.dp", "meta.json"]

    # a later run: step 1 is replayed (no request), tokens and log-probs as dumped, at the version served now
    second = answering([9, 9, 3], version=7)
    stage = GenerateStage(servers=[second], config=config, clock=ClockRef.in_process(StalenessGate(2)))
    replayed = generate(stage, 0)
    assert second.calls == []
    assert [s.response_ids for s in replayed.samples] == [s.response_ids for s in dumped.samples] == [[7, 13, 3]] * 4
    assert [s.uid for s in replayed.samples] == [s.uid for s in dumped.samples]  # GRPO's groups as dumped
    assert [s.rollout_log_probs for s in replayed.samples] == [s.rollout_log_probs for s in dumped.samples]
    assert [s.non_tensor["reward_model"] for s in replayed.samples] == [s.non_tensor["reward_model"] for s in dumped.samples]
    assert {tuple(s.token_versions) for s in dumped.samples} == {(4, 4, 4)}
    assert {tuple(s.token_versions) for s in replayed.samples} == {(0, 0, 0)}  # the version served at replay

    # step 2 is not listed: generated, not dumped; step 3 is listed and not dumped yet: generated, then dumped
    generate(stage, 1)
    assert len(second.calls) == 4 and not (run_dir / "2").exists()
    generate(stage, 2)
    assert len(second.calls) == 8 and (run_dir / "3" / "gen_batch.dp").is_file()
    # validation is never replayed
    asyncio.run(asyncio.wait_for(stage.run_agent_loops(ROWS, 1, validate=True, step=1), 60))
    assert len(second.calls) == 10


def test_repeat_replays_the_nearest_dumped_step(demo_dir, tmp_path):
    cache = skip_config(demo_dir, tmp_path / "dumps", steps="[1]")
    generate(GenerateStage(servers=[answering([5, 3], 1)], config=cache, clock=ClockRef.in_process(StalenessGate(2))), 0)
    repeat = skip_config(demo_dir, tmp_path / "dumps", steps="[1,2,3]", action="repeat")
    server = answering([6, 3], 1)
    stage = GenerateStage(servers=[server], config=repeat, clock=ClockRef.in_process(StalenessGate(2)))
    assert [s.response_ids for s in generate(stage, 2).samples] == [[5, 3]] * 4  # step 3: step 1's dump
    assert server.calls == []


def test_off_by_default_and_bad_values_refused_naming_the_section(demo_dir, tmp_path):
    from async_rl.core.config import strip_async_keys
    from async_rl.demo import demo_overrides

    config = compose_ppo(demo_overrides(demo_dir))
    strip_async_keys(config)
    assert RolloutDumps.from_config(config) is None
    with pytest.raises(AsyncConfigError, match=r"skip\.rollout=.*action.*cache/repeat"):
        RolloutDumps.from_config(skip_config(demo_dir, tmp_path, action="random"))
    with pytest.raises(AsyncConfigError, match=r"skip\.rollout=.*steps"):
        RolloutDumps.from_config(skip_config(demo_dir, tmp_path, steps="[one]"))
