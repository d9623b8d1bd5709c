"""A reward model on the CPU backend (async_rl/rollout/cpu/reward_server.py, async_rl/rollout/reward_models.py):
its server answers vLLM's `/classify` through verl's router, verl's own reward loop scores with it (the
patch for `rollout.name=cpu`), a user's reward function reaches it through the router, and a lost
server is named within the timeout instead of waiting."""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import ray
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from async_rl.core.reward_loop_scoring import RewardLoopScorer, one_row
from async_rl.rollout.cpu.reward_server import check_reward_model
from async_rl.rollout.reward_models import reward_model_devices, reward_model_replica_count, start_reward_model
from helpers.clusters import RAY_CALL_GUARD_S

RAW_PROMPT = [{"role": "user", "content": "1234"}]


def config_for(demo_dir, extra: dict):
    import verl

    from async_rl.demo import demo_overrides

    rm = {"reward.reward_model.enable": True, "reward.reward_model.model_path": str(demo_dir / "reward_model"),
          "reward.reward_model.rollout.name": "cpu", "reward.reward_model.rollout.tensor_model_parallel_size": 1,
          "trainer.n_gpus_per_node": 1}
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        return compose("ppo_trainer", overrides=demo_overrides(demo_dir, extra={**rm, **extra}))


async def score_in_a_loop(config, router: str, rows: list, timeout_s: float):
    return await RewardLoopScorer(config, router).score(rows, timeout_s)


def prompt_ids(tokenizer) -> list[int]:
    return tokenizer(tokenizer.apply_chat_template(RAW_PROMPT, add_generation_prompt=True, tokenize=False))["input_ids"]


def verl_recipe_score(demo_dir, prompt_ids, response_ids) -> float:
    """The score verl's reward loop asks for, computed here by hand: the response decoded (special tokens
    kept, eos removed), appended to the raw prompt as the assistant's turn, the reward model's chat template,
    one forward, the score head's logit."""
    path = demo_dir / "reward_model"
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    response = tokenizer.decode(response_ids).replace(tokenizer.eos_token, "")
    text = tokenizer.apply_chat_template([*RAW_PROMPT, {"role": "assistant", "content": response}],
                                         add_generation_prompt=False, tokenize=False)
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([tokenizer(text)["input_ids"]])).logits[0, -1])


def kill_and_wait(server, timeout_s: float = 120.0) -> None:
    """ray.kill returns before the actor is gone, and Ray marks it dead before its process exits (a row
    sent meanwhile may be scored by the dying server, on a loaded machine for seconds): wait until its
    process is gone."""
    pid = ray.get(server.__ray_call__.remote(lambda _server: os.getpid()), timeout=RAY_CALL_GUARD_S)
    ray.kill(server)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.1)
    raise AssertionError(f"the killed server's process {pid} is still there after {timeout_s:g} s")


@pytest.fixture
def reward_model(demo_dir, ray_cluster):
    config = config_for(demo_dir, {"reward.custom_reward_function.path": None})
    service = start_reward_model(config, timeout_s=RAY_CALL_GUARD_S)
    yield config, service
    service.stop()


def test_verls_reward_loop_scores_with_the_cpu_reward_model(demo_dir, reward_model):
    config, service = reward_model
    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "model")
    prompt = prompt_ids(tokenizer)
    # a response with special tokens inside (a random policy samples them): kept in the text, as verl keeps them
    response = tokenizer("12")["input_ids"] + [tokenizer.pad_token_id] + tokenizer("4")["input_ids"]
    row = one_row(prompt, response, {"raw_prompt": RAW_PROMPT, "data_source": "d",
                                           "reward_model": {"ground_truth": "1234"}})

    scores, failures = asyncio.run(score_in_a_loop(config, service.router_address, [row, row], 60))
    assert failures == []
    expected = verl_recipe_score(demo_dir, prompt, response)
    assert scores.tolist() == pytest.approx([expected, expected], abs=1e-6)


def listening_on(pid: int, port: int) -> list:
    """The addresses process `pid` listens on at `port` (TCP)."""
    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def test_the_server_answers_vllms_classify_through_verls_router(demo_dir, reward_model):
    """Through verl's router, and both listen on the address they advertise only: loopback on one node."""
    _, service = reward_model
    server = service.replicas[0].servers[0]
    server_pid = ray.get(server.__ray_call__.remote(lambda _server: os.getpid()), timeout=RAY_CALL_GUARD_S)
    for pid, address in ((service.router_process.pid, service.router_address),
                         (server_pid, service.replicas[0].server_address)):
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1" and listening_on(pid, int(port)) == [(host, int(port))], (address, pid)
    body = json.dumps({"model": "rm", "input": ["1234", "12345"], "use_activation": False}).encode()
    request = urllib.request.Request(f"http://{service.router_address}/classify", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        data = json.loads(answer.read())["data"]
    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "reward_model")
    model = AutoModelForSequenceClassification.from_pretrained(demo_dir / "reward_model").eval()
    with torch.no_grad():
        logits = [float(model(input_ids=torch.tensor([tokenizer(t)["input_ids"]])).logits[0, 0]) for t in ("1234", "12345")]
    assert [row["index"] for row in data] == [0, 1] and all(row["num_classes"] == 1 for row in data)
    assert [row["probs"][-1] for row in data] == pytest.approx(logits, abs=1e-6)


def test_a_reward_function_gets_the_router_and_combines_the_score(demo_dir, ray_cluster):
    """verl's way of combining a rule reward with a reward model: the user's function is given
    `reward_router_address` and `reward_model_tokenizer` (an exact copy scores 1 + the model's score)."""
    path = Path(__file__).parents[1] / "e2e" / "rm_plus_rule_reward.py"
    config = config_for(demo_dir, {"reward.custom_reward_function.path": str(path)})
    service = start_reward_model(config, timeout_s=RAY_CALL_GUARD_S)
    try:
        tokenizer = AutoTokenizer.from_pretrained(demo_dir / "model")
        prompt = prompt_ids(tokenizer)
        response = tokenizer("1234")["input_ids"]
        row = one_row(prompt, response, {"raw_prompt": RAW_PROMPT, "data_source": "d",
                                         "reward_model": {"ground_truth": "1234"}})
        scores, failures = asyncio.run(score_in_a_loop(config, service.router_address, [row], 60))
    finally:
        service.stop()
    assert failures == []
    assert scores.item() == pytest.approx(1.0 + verl_recipe_score(demo_dir, prompt, response), abs=1e-6)


def test_a_lost_reward_model_is_named_within_the_timeout(demo_dir, ray_cluster):
    """No restarts left (actor_rollout_ref.rollout.max_restarts=0): verl's client would retry for minutes;
    the row's deadline names it."""
    config = config_for(demo_dir, {"reward.custom_reward_function.path": None})
    service = start_reward_model(config, timeout_s=RAY_CALL_GUARD_S, max_restarts=0)
    try:
        for replica in service.replicas:
            kill_and_wait(replica.servers[0])
        row = one_row([1, 2], [3], {"raw_prompt": RAW_PROMPT, "data_source": "d", "reward_model": {"ground_truth": "1"}})
        scores, failures = asyncio.run(score_in_a_loop(config, service.router_address, [row], 5))
    finally:
        service.stop()
    assert scores.tolist() == [0.0]
    assert failures == [(0, "no score within reward.async_timeout_s=5 s")]


def test_a_lost_reward_model_server_is_started_again_on_its_address(demo_dir, ray_cluster):
    """A killed server is restarted on the same port (verl's router keeps its address list); a row sent
    meanwhile is scored once it is back, within its deadline."""
    config = config_for(demo_dir, {"reward.custom_reward_function.path": None})
    service = start_reward_model(config, timeout_s=RAY_CALL_GUARD_S, max_restarts=1)
    try:
        replica = service.replicas[0]
        address = replica.server_address
        kill_and_wait(replica.servers[0])
        tokenizer = AutoTokenizer.from_pretrained(demo_dir / "model")
        prompt, response = prompt_ids(tokenizer), tokenizer("1234")["input_ids"]
        row = one_row(prompt, response, {"raw_prompt": RAW_PROMPT, "data_source": "d",
                                         "reward_model": {"ground_truth": "1234"}})
        scores, failures = asyncio.run(score_in_a_loop(config, service.router_address, [row], 120))
    finally:
        service.stop()
    assert failures == [] and service.restarts == [1]
    assert replica.server_address == address
    assert scores.item() == pytest.approx(verl_recipe_score(demo_dir, prompt, response), abs=1e-6)


def test_verl_refuses_the_cpu_reward_model_without_the_patch(demo_dir):
    """verl 0.9.1 raises for any rollout.name but vllm / sglang / trtllm; the patch sends vLLM's request."""
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    from verl_patches.cpu_reward_model import patch_disrm_on_cpu

    patch_disrm_on_cpu()
    worker = RewardLoopWorker.__new__(RewardLoopWorker)
    worker.config = config_for(demo_dir, {})
    worker.reward_model_tokenizer = worker.input_tokenizer = AutoTokenizer.from_pretrained(demo_dir / "reward_model")
    row = one_row([1, 2], [3], {"raw_prompt": RAW_PROMPT})
    with pytest.raises(NotImplementedError, match="does not support cpu"):
        asyncio.run(RewardLoopWorker.compute_score_disrm.__wrapped__(worker, row))
    sent = []

    async def post(payload, endpoint):
        sent.append((endpoint, payload))
        return {"data": [{"probs": [0.25]}]}

    worker._post_request = post
    assert asyncio.run(RewardLoopWorker.compute_score_disrm(worker, row)) == {"reward_score": 0.25}
    assert sent[0][0] == "classify" and sent[0][1]["use_activation"] is False


def test_replicas_as_verl_counts_them(demo_dir):
    assert reward_model_replica_count(config_for(demo_dir, {"trainer.n_gpus_per_node": 4})) == 4
    two = {"trainer.n_gpus_per_node": 4, "reward.reward_model.rollout.tensor_model_parallel_size": 2}
    assert reward_model_replica_count(config_for(demo_dir, two)) == 2
    own = {"reward.reward_model.enable_resource_pool": True, "reward.reward_model.n_gpus_per_node": 3,
           "reward.reward_model.nnodes": 1}
    assert reward_model_replica_count(config_for(demo_dir, own)) == 3


def test_a_reward_model_on_a_gpu_server_takes_devices_of_its_own_on_the_cpu_backend_none(demo_dir):
    """The backend table's `gpu_server` row field decides it (async_rl/rollout/backends.py)."""
    own = {"reward.reward_model.n_gpus_per_node": 2, "reward.reward_model.nnodes": 1}
    assert reward_model_devices(config_for(demo_dir, own)) == 0  # config_for: the CPU backend
    for gpu_server in ("vllm", "sglang"):
        assert reward_model_devices(config_for(demo_dir, {**own, "reward.reward_model.rollout.name": gpu_server})) == 2


def test_a_generative_model_is_refused_by_the_cpu_backend(demo_dir):
    assert check_reward_model(str(demo_dir / "reward_model")) is None
    assert "generative one needs vLLM or SGLang" in check_reward_model(str(demo_dir / "model"))


def test_the_scorer_is_built_in_the_loop_that_scores(demo_dir):
    """verl's reward managers keep the event loop they were built in: built outside one, the scorer says so
    at once rather than failing each call with 'attached to a different loop'."""
    with pytest.raises(RuntimeError, match="no running event loop"):
        RewardLoopScorer(config_for(demo_dir, {}), "127.0.0.1:1")
