"""Rollout backend selection (the table of async_rl/rollout/backends.py, verl's replicas:
async_rl/rollout/verl_replicas.py) and the requests the generate stage builds.

verl's sglang / vllm servers cannot start without a GPU, so what is checked here is
everything up to the server: the name -> replica-class selection, the fail-fast errors,
and that the generate stage's requests fit verl's GPU servers' `generate` (signatures
read from verl's source, which imports without vllm / sglang).
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import inspect
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import async_rl.rollout.backends  # noqa: F401 - registers the built-in rollout backends
from async_rl.api.rollout import rollout_backend
from async_rl.core.errors import AsyncConfigError
from async_rl.core.messages import PromptBatch
from async_rl.rollout.verl_replicas import make_rollout_replicas
from helpers.lineage import compose_ppo
from helpers.scripted_server import ScriptedServer
from async_rl.core.policy_clock import ClockRef
from async_rl.core.staleness import StalenessGate
from state_machines.generate import GenerateStage

GPU_SERVERS = {
    "vllm": ("workers/rollout/vllm_rollout/vllm_async_server.py", "vLLMHttpServer"),
    "sglang": ("workers/rollout/sglang_rollout/async_sglang_server.py", "SGLangHttpServer"),
}
# the sampling keys verl's own agent loop sends these servers (verl/experimental/agent_loop/agent_loop.py)
VERL_AGENT_LOOP_KEYS = {"temperature", "top_p", "top_k", "repetition_penalty", "logprobs"}
MESSAGES = [[{"role": "user", "content": "copy 123"}], [{"role": "user", "content": "copy 45"}]]


def demo_config(demo_dir, **rollout):
    """The demo's verl config with `actor_rollout_ref.rollout.<key>=<value>` for each of `rollout`
    (n=2 and response_length=5 unless given), as the pipeline hands it to its stages."""
    from async_rl.core.config import strip_async_keys
    from async_rl.demo import demo_overrides

    rollout = {"n": 2, "response_length": 5, **rollout}
    config = compose_ppo(demo_overrides(demo_dir, extra={f"actor_rollout_ref.rollout.{k}": v for k, v in rollout.items()}))
    strip_async_keys(config)
    return config


def server_generate_def(name: str) -> ast.AsyncFunctionDef:
    """The `generate` method of verl's GPU server class, parsed from verl's source (no import)."""
    import verl

    path, cls_name = GPU_SERVERS[name]
    tree = ast.parse((Path(verl.__file__).parent / path).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    return next(n for n in cls.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "generate")


def signature_of(fn: ast.AsyncFunctionDef) -> inspect.Signature:
    args = fn.args
    defaults = [None] * (len(args.args) - len(args.defaults)) + list(args.defaults)
    params = [
        inspect.Parameter(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, **({} if d is None else {"default": None}))
        for a, d in zip(args.args, defaults)
    ]
    if args.kwarg is not None:
        params.append(inspect.Parameter(args.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(params)


def popped_sampling_keys(fn: ast.AsyncFunctionDef) -> set[str]:
    """Keys the server's generate pops or reads from `sampling_params` itself."""
    keys = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("pop", "get"):
            if isinstance(node.func.value, ast.Name) and node.func.value.id == "sampling_params" and node.args:
                if isinstance(node.args[0], ast.Constant):
                    keys.add(node.args[0].value)
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant):
            if any(isinstance(c, ast.Name) and c.id == "sampling_params" for c in node.comparators):
                keys.add(node.left.value)
    return keys


def recording_server() -> ScriptedServer:
    """Answers every request with tokens [5, 6]."""
    return ScriptedServer(lambda kwargs, calls: ([5, 6], None, "completed"))


def captured_requests(config, validate: bool = False) -> list[dict]:
    """The requests the generate stage sends for two chat prompts (`MESSAGES`), through verl's agent loop."""
    servers = [recording_server(), recording_server()]
    stage = GenerateStage(servers=servers, config=config, clock=ClockRef.in_process(StalenessGate(1)))
    rows = [{"raw_prompt": messages, "data_source": "d", "index": i} for i, messages in enumerate(MESSAGES)]
    if validate:
        samples = asyncio.run(asyncio.wait_for(stage.run_agent_loops(rows, 1, validate=True), 60))
    else:
        samples = asyncio.run(asyncio.wait_for(stage.process_data(PromptBatch(0, rows)), 60)).samples
    n = 1 if validate else int(config.actor_rollout_ref.rollout.n)
    assert len(samples) == 2 * n and all(s.response_ids == [5, 6] for s in samples)
    calls = servers[0].calls + servers[1].calls
    assert len(servers[0].calls) == len(servers[1].calls) == n  # spread round-robin
    return calls


# ---- selection ------------------------------------------------------------------------


def test_unknown_backend_lists_the_registered_ones():
    with pytest.raises(AsyncConfigError) as info:
        rollout_backend("hf")
    message = str(info.value)
    assert info.value.key == "actor_rollout_ref.rollout.name" and "actor_rollout_ref.rollout.name='hf'" in message
    for name in ("cpu", "vllm", "sglang", "trtllm"):
        assert repr(name) in message


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_gpu_backend_with_cpu_device_fails_fast(name, monkeypatch):
    from verl_patches import vllm_cpu

    monkeypatch.setattr(vllm_cpu, "vllm_cpu_installed", lambda: False)
    monkeypatch.setattr("async_rl.rollout.vllm.vllm_cpu_installed", lambda: False)
    with pytest.raises(AsyncConfigError, match=rf"rollout.name='{name}'; allowed: cpu on trainer.device=cpu "
                                               rf"\({name} runs verl's GPU server"):
        rollout_backend(name, device="cpu")


def test_vllm_on_cpu_is_allowed_where_its_cpu_build_is_installed(monkeypatch):
    monkeypatch.setattr("async_rl.rollout.vllm.vllm_cpu_installed", lambda: True)
    assert rollout_backend("vllm", device="cpu").name == "vllm"
    with pytest.raises(AsyncConfigError, match="trainer.device=cpu"):
        rollout_backend("sglang", device="cpu")


@pytest.mark.parametrize("name, package, install", [("vllm", "vllm", "verl-async-rl[vllm]"),
                                                     ("sglang", "sglang", "verl-async-rl[sglang]"),
                                                     ("trtllm", "tensorrt_llm", "pip install tensorrt_llm")])
def test_gpu_backend_needs_its_engine_package(name, package, install):
    """Without the package: a message naming it and the install; with it: verl's replica class."""
    if importlib.util.find_spec(package) is None:
        with pytest.raises(AsyncConfigError) as info:
            rollout_backend(name, device="cuda")
        assert f"it needs {package!r}" in str(info.value) and install in str(info.value)
    else:
        from verl.workers.rollout.replica import get_rollout_replica_class

        rollout_backend(name, device="cuda")
        assert get_rollout_replica_class(name).__name__ == {"vllm": "vLLMReplica", "sglang": "SGLangReplica",
                                                           "trtllm": "TRTLLMReplica"}[name]


def test_the_table_says_what_each_backend_can_do():
    cpu, vllm, sglang = rollout_backend("cpu"), rollout_backend("vllm"), rollout_backend("sglang")
    assert cpu.relaunch and vllm.relaunch and sglang.relaunch is None  # restartable replicas
    assert cpu.waits_for_running and vllm.waits_for_running and not sglang.waits_for_running
    assert not cpu.starts_on_dummy_weights and vllm.starts_on_dummy_weights and sglang.starts_on_dummy_weights
    assert (cpu.default_max_restarts, vllm.default_max_restarts) == (3, 0)
    assert cpu.receivers_tell_nodes and not vllm.receivers_tell_nodes  # same-node transports reach CPU servers only
    tp2 = OmegaConf.create({"tensor_model_parallel_size": 2, "data_parallel_size": 1, "pipeline_model_parallel_size": 1})
    assert (cpu.replica_world_size(tp2), vllm.replica_world_size(tp2)) == (1, 2)


def test_cpu_backend_builds_the_replicas_asked_for(demo_dir):
    from async_rl.core.config import strip_async_keys
    from async_rl.demo import demo_overrides
    from async_rl.rollout.cpu.replica import CPURolloutReplica

    config = compose_ppo(demo_overrides(demo_dir))
    strip_async_keys(config)  # as the pipeline does before verl sees the config
    replicas = make_rollout_replicas(config, count=3)
    assert [type(r) for r in replicas] == [CPURolloutReplica] * 3
    assert [r.replica_rank for r in replicas] == [0, 1, 2]


# ---- the requests ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GPU_SERVERS))
def test_generate_requests_fit_verl_gpu_server(name, demo_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "model")
    chat = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True) for m in MESSAGES]
    chat = [list(ids["input_ids"] if hasattr(ids, "keys") else ids) for ids in chat]
    fn = server_generate_def(name)
    signature = signature_of(fn)
    handled = popped_sampling_keys(fn) | VERL_AGENT_LOOP_KEYS
    assert {"max_tokens", "max_new_tokens", "logprobs"} <= popped_sampling_keys(fn)  # the parser sees them
    for config in (demo_config(demo_dir), demo_config(demo_dir, temperature=0.7, top_p=0.9, top_k=20)):
        for call in captured_requests(config):
            signature.bind("self", **call)  # raises TypeError on a keyword the server does not take
            assert set(call["sampling_params"]) <= handled, set(call["sampling_params"]) - handled
            assert call["prompt_ids"] in chat  # the chat template's tokens, as verl's agent loop builds them
            assert call["sampling_params"]["max_tokens"] == 5 and call["sampling_params"]["logprobs"] is True


def test_sampling_params_follow_the_rollout_config(demo_dir):
    """verl's agent loop's sampling: the rollout keys in training, `val_kwargs` in validation."""
    val = {"val_kwargs.do_sample": True, "val_kwargs.temperature": 0.5, "val_kwargs.top_p": 0.8, "val_kwargs.top_k": 3}
    config = demo_config(demo_dir, temperature=0.7, top_p=0.9, top_k=20, **val)
    train = {k: captured_requests(config)[0]["sampling_params"][k] for k in ("temperature", "top_p", "top_k")}
    val = {k: captured_requests(config, validate=True)[0]["sampling_params"][k] for k in ("temperature", "top_p", "top_k")}
    assert (train, val) == ({"temperature": 0.7, "top_p": 0.9, "top_k": 20}, {"temperature": 0.5, "top_p": 0.8, "top_k": 3})


def test_requests_with_a_distinct_id_each(demo_dir):
    calls = captured_requests(demo_config(demo_dir))
    assert len({c["request_id"] for c in calls}) == len(calls)


def test_aborted_request_is_resubmitted_with_its_tokens_and_the_remaining_budget():
    """verl's GPU servers abort in-flight requests around a weight load; nothing generated is lost."""
    from verl.workers.rollout.replica import TokenOutput

    from async_rl.rollout.requests import generate_resumable

    calls = []
    replies = [
        TokenOutput(token_ids=[7, 8], log_probs=[-0.1, -0.2], stop_reason="aborted", extra_fields={"global_steps": 3}),
        TokenOutput(token_ids=[], log_probs=[], stop_reason="aborted", extra_fields={"global_steps": 4}),
        TokenOutput(token_ids=[9], log_probs=[-0.3], stop_reason="completed", extra_fields={"global_steps": 4}),
    ]

    class Server:
        class generate:  # noqa: N801 - mimics a Ray actor method
            @staticmethod
            async def remote(**kwargs):
                calls.append(kwargs)
                return replies[len(calls) - 1]

    from async_rl.rollout.supervisor import ReplicaSupervisor

    async def main():
        return await generate_resumable(ReplicaSupervisor([Server]), 0, [1, 2], {"temperature": 1.0, "max_tokens": 5},
                                        10, served_version=3)

    out = asyncio.run(main())
    assert (out.token_ids, out.log_probs, out.token_versions, out.segments) == (
        [7, 8, 9], [-0.1, -0.2, -0.3], [3, 3, 4], 3
    )
    assert [c["prompt_ids"] for c in calls] == [[1, 2], [1, 2, 7, 8], [1, 2, 7, 8]]
    assert [c["sampling_params"]["max_tokens"] for c in calls] == [5, 3, 3]
