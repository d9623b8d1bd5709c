"""verl's rollout trace under the flag (`actor_rollout_ref.rollout.trace.*`), without Ray: the generate stage's
agent-loop worker (verl's) sets up the backend, and each trajectory is a trace tagged with its step, sample and
rollout, holding the agent loop's span and a span per model request (the pipeline's client, as verl's); with
`token2text` the request's span holds the response as text. Backend: mlflow on a SQLite file. A backend whose
package is not installed, or that verl does not know, is refused at start naming the key."""

from __future__ import annotations

import asyncio

import pytest

from async_rl.core.errors import AsyncConfigError
from async_rl.core.messages import PromptBatch
from async_rl.core.policy_clock import ClockRef
from async_rl.core.staleness import StalenessGate
from async_rl.rollout.agent_loop_files import check_trace_backend
from helpers.lineage import compose_ppo
from helpers.scripted_server import ScriptedServer
from state_machines.generate import GenerateStage

ROWS = [{"raw_prompt": [{"role": "user", "content": f"copy {d}"}], "data_source": "d", "index": i,
         "reward_model": {"ground_truth": d}} for i, d in enumerate(("123", "4567"))]


def trace_config(demo_dir, *keys: str):
    from async_rl.core.config import strip_async_keys
    from async_rl.demo import demo_overrides

    config = compose_ppo(demo_overrides(demo_dir, extra=["actor_rollout_ref.rollout.n=2", *keys]))
    strip_async_keys(config)
    return config


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """MLflow's tracking store for this test (a SQLite file, as verl's default is); verl's trace config is a
    process-wide singleton: reset before and after."""
    from verl.utils.rollout_trace import RolloutTraceConfig

    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)  # an experiment's artifacts go to ./mlruns
    RolloutTraceConfig.reset()
    yield uri
    RolloutTraceConfig.reset()


def test_each_trajectory_is_a_trace_with_its_loop_and_its_requests(demo_dir, mlflow_store):
    import mlflow

    config = trace_config(demo_dir, "actor_rollout_ref.rollout.trace.backend=mlflow",
                          "actor_rollout_ref.rollout.trace.token2text=true")
    server = ScriptedServer(lambda kwargs, calls: ([7, 13, 3], 0, "completed"))
    stage = GenerateStage(servers=[server], config=config, clock=ClockRef.in_process(StalenessGate(2)))
    asyncio.run(asyncio.wait_for(stage.process_data(PromptBatch(0, ROWS)), 120))  # step 1's batch
    asyncio.run(asyncio.wait_for(stage.run_agent_loops(ROWS, 1, validate=True, step=1), 120))  # validation after it
    assert len(server.calls) == 6
    mlflow.flush_trace_async_logging()
    experiment = mlflow.get_experiment_by_name(config.trainer.project_name)  # verl names it after the project
    traces = mlflow.search_traces(locations=[experiment.experiment_id], return_type="list")
    by_kind = {kind: sorted((t.info.tags["step"], t.info.tags["sample_index"], t.info.tags["rollout_n"])
                            for t in traces if t.info.tags["validate"] == kind) for kind in ("False", "True")}
    assert by_kind == {"False": [("1", "0", "0"), ("1", "0", "1"), ("1", "1", "0"), ("1", "1", "1")],  # n = 2
                       "True": [("1", "0", "0"), ("1", "1", "0")]}
    for trace in traces:
        names = [span.name for span in trace.data.spans]
        assert names[0] == "agent_loop" and "SingleTurnAgentLoop.run" in names
        requests = [span for span in trace.data.spans if span.name == "PipelineLLMClient.generate"]
        assert len(requests) == 1
        outputs = requests[0].outputs
        assert outputs["token_ids"] == [7, 13, 3]
        assert outputs["response_text"] == stage.agent_loops().tokenizer.decode([7, 13, 3])  # token2text


def test_an_unknown_or_uninstalled_backend_is_refused_at_start_naming_the_key(demo_dir, monkeypatch):
    import importlib.util

    check_trace_backend(trace_config(demo_dir))  # verl's default: no trace
    with pytest.raises(AsyncConfigError, match=r"rollout\.trace\.backend='wandb'; allowed: None or one of verl's"):
        check_trace_backend(trace_config(demo_dir, "actor_rollout_ref.rollout.trace.backend=wandb"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "weave" else real(name, *a))
    with pytest.raises(AsyncConfigError, match=r"rollout\.trace\.backend='weave'; allowed: .*pip install weave"):
        check_trace_backend(trace_config(demo_dir, "actor_rollout_ref.rollout.trace.backend=weave"))
