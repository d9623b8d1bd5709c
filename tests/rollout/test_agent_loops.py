"""verl's agent loops in the generate stage (async_rl/rollout/agent_loops.py), without Ray: a user's
two-turn loop from a test file (tests/e2e/two_turn_loop.py, registered through
`agent_loop_config_path`) on recording servers; what reaches the trainer; the start-time checks."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from omegaconf import open_dict
import torch

from async_rl.core.errors import AsyncConfigError
from async_rl.core.messages import PromptBatch, build_batch, response_lengths
from async_rl.core.scoring import decode_responses
from async_rl.core.staleness import oldest_versions
from async_rl.rollout.agent_loop_files import check_agent_loops
from helpers.lineage import compose_ppo
from state_machines.actor_train import place_scores_on_last_token
from helpers.scripted_server import ScriptedServer
from async_rl.core.policy_clock import ClockRef
from async_rl.core.staleness import StalenessGate
from state_machines.generate import GenerateStage

E2E = Path(__file__).parent.parent / "e2e"
LOOP_FILE = E2E / "two_turn_loop.yaml"
TURNS = [[7, 13, 13, 3], [14, 15, 9]]  # what the engine answers each turn: "4==0", "\n 6"


@pytest.fixture
def two_turn_path(monkeypatch):
    monkeypatch.syspath_prepend(str(E2E))  # where a user's loop module is importable
    yield
    sys.modules.pop("two_turn_loop", None)


def extends_one_of(prompt: list, others: list) -> bool:
    """`prompt` is a strict extension of one of `others` (token lists): a later turn of its trajectory."""
    return any(len(other) < len(prompt) and prompt[:len(other)] == other for other in others)


def versioned_server() -> ScriptedServer:
    """Answers turn t of each trajectory with TURNS[t] under weight version 3 + t (a weight load between
    the turns). A second turn's prompt extends an earlier call's prompt on this server; a first turn's
    extends none, whichever trajectories (the same prompt's samples too) the server got and in what order."""
    def answer(kwargs, calls):
        turn = int(extends_one_of(kwargs["prompt_ids"], [c["prompt_ids"] for c in calls]))
        return TURNS[turn], 3 + turn, "completed"

    return ScriptedServer(answer)


@pytest.fixture
def merging_model(demo_dir, tmp_path) -> Path:
    """The demo model with a tokenizer that also has "==" as one token: the engine's "=", "=" decodes to
    text that encodes to the one token, so decode/encode is not the identity."""
    import shutil

    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(demo_dir / "model", model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_tokens(["=="])
    tokenizer.save_pretrained(model)
    return model


def config_with(demo_dir, model=None, **agent):
    from async_rl.core.config import strip_async_keys
    from async_rl.demo import demo_overrides

    extra = {"actor_rollout_ref.rollout.n": 2, "actor_rollout_ref.rollout.response_length": 12,
             **({"actor_rollout_ref.model.path": str(model)} if model else {}),
             **{f"actor_rollout_ref.rollout.agent.{k}": v for k, v in agent.items()}}
    config = compose_ppo(demo_overrides(demo_dir, extra=extra))
    strip_async_keys(config)
    return config


def test_a_users_multi_turn_loop_reaches_the_trainer_token_for_token(demo_dir, merging_model, two_turn_path):
    from transformers import AutoTokenizer

    from two_turn_loop import ENV_REPLY

    tokenizer = AutoTokenizer.from_pretrained(merging_model)
    env = tokenizer.encode(ENV_REPLY, add_special_tokens=False)
    # decoding and encoding again would change these tokens: a text round trip would show
    assert any(tokenizer.encode(tokenizer.decode(t), add_special_tokens=False) != t for t in TURNS)

    config = config_with(demo_dir, merging_model, agent_loop_config_path=str(LOOP_FILE), default_agent_loop="two_turn")
    check_agent_loops(config)
    servers = [versioned_server(), versioned_server()]
    stage = GenerateStage(servers=servers, config=config, clock=ClockRef.in_process(StalenessGate(1)))
    rows = [{"raw_prompt": [{"role": "user", "content": f"copy {d}"}], "data_source": "d", "index": i,
             "reward_model": {"ground_truth": d}} for i, d in enumerate(("123", "4567"))]
    out = asyncio.run(asyncio.wait_for(stage.process_data(PromptBatch(0, rows)), 60))

    assert len(out.samples) == 4
    for sample in out.samples:
        assert sample.response_ids == TURNS[0] + env + TURNS[1]
        assert sample.response_mask == [1] * 4 + [0] * len(env) + [1] * 3
        assert sample.token_versions == [3] * 4 + [-1] * len(env) + [4] * 3  # each model token its version
        assert sample.rollout_log_probs == [-0.5] * 4 + [0.0] * len(env) + [-0.5] * 3
        assert sample.non_tensor["__num_turns__"] == 4 and sample.non_tensor["agent_name"] == "two_turn"
        assert sample.non_tensor["turns_interrupted"] == 0
    for server in servers:  # each trajectory's second turn: its prompt + the engine's tokens + env, on the same server
        prompts = [c["prompt_ids"] for c in server.calls]
        firsts = [p for p in prompts if not extends_one_of(p, prompts)]
        assert len(firsts) == 2 and sorted(map(tuple, prompts)) == sorted(
            [tuple(p) for p in firsts] + [tuple(p + TURNS[0] + env) for p in firsts])

    batch = build_batch(out.samples, 32, 12, pad_token_id=0)
    mask, length = batch.batch["response_mask"], len(out.samples[0].response_ids)
    assert mask[:, 4:4 + len(env)].sum() == 0 and mask[:, :4].all() and mask[:, 4 + len(env):length].all()
    assert batch.batch["attention_mask"][:, 32:32 + length].all()  # the environment's tokens are context
    assert batch.batch["responses"][:, :length].tolist() == [TURNS[0] + env + TURNS[1]] * 4
    assert oldest_versions(batch.batch["token_versions"], mask, [0] * 4).tolist() == [3] * 4
    # the reward scores the whole response and sits on its last token, as verl's reward managers do
    scored = decode_responses(batch, tokenizer)[0]
    assert scored.length == length and scored.solution_str == tokenizer.decode(TURNS[0] + env + TURNS[1],
                                                                                skip_special_tokens=True)
    scores = place_scores_on_last_token(torch.ones(4), response_lengths(batch), 12)
    assert scores[:, length - 1].tolist() == [1.0] * 4 and scores.sum() == 4


def loading_server(env: list[int]) -> ScriptedServer:
    """A weight load interrupts every trajectory's second turn: the first turn under version 3, the
    second aborted after one token (version 4) and resumed under version 5."""
    def answer(kwargs, calls):
        prompt = kwargs["prompt_ids"]
        if prompt[-len(env):] == env:
            return [14], 4, "aborted"
        if prompt[-len(env) - 1:-1] == env:
            return [15, 9], 5, "completed"
        return TURNS[0], 3, "completed"

    return ScriptedServer(answer)


def test_a_weight_load_inside_a_turn_resumes_it_and_each_token_keeps_its_version(demo_dir, two_turn_path):
    from transformers import AutoTokenizer

    from two_turn_loop import ENV_REPLY

    env = AutoTokenizer.from_pretrained(demo_dir / "model").encode(ENV_REPLY, add_special_tokens=False)
    server = loading_server(env)
    config = config_with(demo_dir, default_agent_loop="two_turn", agent_loop_config_path=str(LOOP_FILE))
    stage = GenerateStage(servers=[server], config=config, clock=ClockRef.in_process(StalenessGate(2)))
    rows = [{"raw_prompt": [{"role": "user", "content": "copy 12"}], "data_source": "d", "index": 0}]
    (sample, _) = asyncio.run(asyncio.wait_for(stage.run_agent_loops(rows, 2), 60))
    assert sample.response_ids == TURNS[0] + env + [14, 15, 9]
    assert sample.token_versions == [3] * 4 + [-1] * len(env) + [4, 5, 5]
    assert sample.non_tensor["turns_interrupted"] == 1
    resumed = [c for c in server.calls if c["prompt_ids"][-len(env) - 1:-1] == env]
    aborted = [c for c in server.calls if c["prompt_ids"][-len(env):] == env]
    for before, after in zip(aborted, resumed):  # prompt + the tokens so far; the budget less what was generated
        assert after["prompt_ids"] == before["prompt_ids"] + [14]
        assert after["sampling_params"]["max_tokens"] == before["sampling_params"]["max_tokens"] - 1


def test_validation_and_training_run_the_rows_own_agent_loop(demo_dir, two_turn_path):
    """A row's `agent_name` picks its loop (verl's per-row column); the default covers the others."""
    config = config_with(demo_dir, agent_loop_config_path=str(LOOP_FILE))
    stage = GenerateStage(servers=[versioned_server()], config=config, clock=ClockRef.in_process(StalenessGate(1)))
    rows = [{"raw_prompt": [{"role": "user", "content": "copy 1"}], "data_source": "d", "index": 0,
             "agent_name": "two_turn"},
            {"raw_prompt": [{"role": "user", "content": "copy 2"}], "data_source": "d", "index": 1,
             "agent_name": "single_turn_agent"}]
    samples = asyncio.run(asyncio.wait_for(stage.run_agent_loops(rows, 1, validate=True), 60))
    assert [s.non_tensor["__num_turns__"] for s in samples] == [4, 2]
    assert samples[1].response_mask == [1] * len(samples[1].response_ids)


def test_unknown_default_loop_is_refused_naming_the_key_and_the_registered_loops(demo_dir, two_turn_path):
    with pytest.raises(AsyncConfigError, match=r"default_agent_loop='three_turn'.*single_turn_agent.*tool_agent.*two_turn"):
        check_agent_loops(config_with(demo_dir, agent_loop_config_path=str(LOOP_FILE), default_agent_loop="three_turn"))


def test_a_missing_or_broken_agent_loop_file_is_refused_naming_the_key(demo_dir, tmp_path, two_turn_path):
    with pytest.raises(AsyncConfigError, match=r"agent_loop_config_path=.*missing.yaml"):
        check_agent_loops(config_with(demo_dir, agent_loop_config_path=str(tmp_path / "missing.yaml")))
    broken = tmp_path / "broken.yaml"
    broken.write_text("- name: nowhere\n  _target_: no_such_module.Loop\n")
    with pytest.raises(AsyncConfigError, match=r"agent loop 'nowhere': _target_ no_such_module.Loop that imports"):
        check_agent_loops(config_with(demo_dir, agent_loop_config_path=str(broken)))


def test_a_missing_tool_file_and_an_unknown_agent_name_in_the_data_are_refused_at_start(demo_dir, tmp_path):
    import pandas as pd

    from async_rl.core.data_checks import agent_names_in

    config = config_with(demo_dir)
    with open_dict(config.actor_rollout_ref.rollout.multi_turn):
        config.actor_rollout_ref.rollout.multi_turn.tool_config_path = str(tmp_path / "tools.yaml")
    with pytest.raises(AsyncConfigError, match=r"multi_turn.tool_config_path=.*tools.yaml'; allowed: an existing file"):
        check_agent_loops(config)
    rows = pd.read_parquet(demo_dir / "data" / "train.parquet").head(4)
    rows["agent_name"] = ["single_turn_agent", "react", "single_turn_agent", None]
    rows.to_parquet(tmp_path / "agents.parquet")
    assert agent_names_in([str(tmp_path / "agents.parquet")]) == {"single_turn_agent", "react"}
    with pytest.raises(AsyncConfigError, match=r"agent_name .*='react'; allowed: a registered agent loop: .*single_turn_agent"):
        check_agent_loops(config_with(demo_dir), agent_names_in([str(tmp_path / "agents.parquet")]))


def test_a_tool_class_that_does_not_import_is_refused_at_start_naming_it(demo_dir, tmp_path):
    # verl 0.9.1's examples name verl.tools.gsm8k_tool.Gsm8kTool, which its wheel does not ship
    tools = tmp_path / "tools.yaml"
    tools.write_text('tools:\n  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"\n    config: {type: native}\n')
    config = config_with(demo_dir)
    with open_dict(config.actor_rollout_ref.rollout.multi_turn):
        config.actor_rollout_ref.rollout.multi_turn.tool_config_path = str(tools)
    with pytest.raises(AsyncConfigError, match=r"multi_turn.tool_config_path=.*tools.yaml'; allowed: a tool config whose "
                                               r"classes import: class_name verl.tools.gsm8k_tool.Gsm8kTool does not "
                                               r"\(ModuleNotFoundError"):
        check_agent_loops(config)
    tools.write_text('tools:\n  - class_name: "verl.tools.base_tool.BaseTool"\n    config: {type: native}\n')
    check_agent_loops(config)  # a class verl ships


def test_agent_files_become_absolute_for_the_stages(demo_dir, monkeypatch, two_turn_path):
    from async_rl.rollout.agent_loop_files import absolute_agent_files

    monkeypatch.chdir(E2E.parent)
    config = config_with(demo_dir, agent_loop_config_path="e2e/two_turn_loop.yaml")
    check_agent_loops(config)
    absolute_agent_files(config)
    assert config.actor_rollout_ref.rollout.agent.agent_loop_config_path == str(LOOP_FILE)


def test_a_hanging_tool_call_ends_within_its_timeout_as_a_reply_the_model_reads(demo_dir):
    """verl's tool agent loop, with the tools the stage's worker loaded: the call that hangs is answered
    by an error naming the tool and `multi_turn.tool_timeout_s`, and the trajectory goes on."""
    import time

    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
    from verl.experimental.agent_loop.tool_parser import FunctionCall

    config = config_with(demo_dir)
    with open_dict(config.actor_rollout_ref.rollout.multi_turn):
        config.actor_rollout_ref.rollout.multi_turn.function_tool_path = str(Path(__file__).parent / "slow_tools.py")
    worker = GenerateStage(servers=[versioned_server()], config=config, clock=ClockRef.in_process(StalenessGate(1)),
                           tool_timeout_s=0.5).agent_loops()
    loop = ToolAgentLoop(trainer_config=DictConfigWrap(worker.config), server_manager=worker.llm_client,
                         tokenizer=worker.tokenizer, processor=None, dataset_cls=worker.dataset_cls,
                         data_config=DictConfigWrap(worker.config.data), tools=ToolListWrap(worker.tools))
    start = time.monotonic()
    reply, reward, _ = asyncio.run(loop._call_tool(FunctionCall(name="lookup_forever", arguments='{"key": "7"}'),
                                                   {}, agent_data=None))
    assert time.monotonic() - start < 5
    assert "'lookup_forever' did not answer within 0.5 s (actor_rollout_ref.rollout.multi_turn.tool_timeout_s)" \
        in reply.text and reward == 0.0


def test_every_call_into_a_stateful_tool_is_bounded():
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import OpenAIFunctionToolSchema

    from async_rl.rollout.agent_loops import ToolTimeoutError, bound_tool_calls

    class Sandbox(BaseTool):
        async def execute(self, instance_id, parameters, **kwargs):
            await asyncio.sleep(3600)

    schema = OpenAIFunctionToolSchema.model_validate(
        {"type": "function", "function": {"name": "sandbox", "description": "runs code",
                                          "parameters": {"type": "object", "properties": {}, "required": []}}})
    tool = Sandbox({}, schema)
    bound_tool_calls(tool, 0.2)
    instance, _ = asyncio.run(tool.create())  # what answers in time is untouched
    with pytest.raises(ToolTimeoutError, match="tool 'sandbox' did not answer within 0.2 s"):
        asyncio.run(tool.execute(instance, {}))


def test_the_loop_factory_builds_what_hydras_instantiate_builds(demo_dir, two_turn_path):
    """The stage builds each trajectory's loop with `loop_factory` (resolved once per name) where verl's
    worker calls `hydra.utils.instantiate` per trajectory: same class, same constructor arguments."""
    import hydra
    from omegaconf import OmegaConf

    from async_rl.rollout.agent_loops import loop_factory

    seen = []

    class Probe:
        def __init__(self, **kwargs):
            seen.append(kwargs)

    module = type(sys)("probe_loops")
    module.Probe = Probe
    sys.modules["probe_loops"] = module
    try:
        for entry in ({"_target_": "probe_loops.Probe"},
                      OmegaConf.create({"name": "probe", "_target_": "probe_loops.Probe", "depth": 3})):
            hydra.utils.instantiate(entry, tools="t", server_manager="s")
            loop_factory(entry)(tools="t", server_manager="s")
            assert seen[-1] == seen[-2] and "tools" in seen[-1]
        assert seen[-1] == {"name": "probe", "depth": 3, "tools": "t", "server_manager": "s"}
        # hydra's own keys stay with hydra
        partial = loop_factory(OmegaConf.create({"_target_": "probe_loops.Probe", "_partial_": True}))
        assert isinstance(partial(tools="t"), __import__("functools").partial)
    finally:
        sys.modules.pop("probe_loops")


def test_a_loop_whose_turn_does_not_extend_the_trajectory_is_refused_naming_why(demo_dir, tmp_path):
    """verl 0.9.1's AgentLoopOutput holds one sequence: a turn whose prompt drops earlier tokens (a summarised
    context) cannot be trained as one trajectory, and the stage says so instead of training a wrong one."""
    from async_rl.rollout.agent_loops import NonExtendingTurnError

    loops = tmp_path / "loops.yaml"
    loops.write_text("- name: summarising\n  _target_: summarising_loop.SummarisingAgentLoop\n")
    config = config_with(demo_dir, agent_loop_config_path=str(loops), default_agent_loop="summarising")
    check_agent_loops(config)
    server = ScriptedServer(lambda kwargs, calls: ([5, 6], 0, "completed"))
    stage = GenerateStage(servers=[server], config=config, clock=ClockRef.in_process(StalenessGate(1)))
    rows = [{"raw_prompt": [{"role": "user", "content": "123"}], "data_source": "d", "index": 0,
             "reward_model": {"ground_truth": "123"}}]
    with pytest.raises(NonExtendingTurnError, match="turn 2: its prompt does not extend the trajectory"):
        asyncio.run(asyncio.wait_for(stage.process_data(PromptBatch(0, rows)), 60))
    prompts = {tuple(call["prompt_ids"]) for call in server.calls}
    assert len(prompts) == 1 and len(next(iter(prompts))) > 1  # the cut context never reached a server
