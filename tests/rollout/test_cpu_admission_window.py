"""The CPU engine's admission window (`engine_kwargs.cpu.admission_window_ms`): requests arriving one by one share a
prefill, rows already decoding go on meanwhile, a full batch is admitted at once, and the option is read from
verl's rollout config and refused, naming its key, when wrong."""

import asyncio

import pytest
import torch
import transformers
from omegaconf import OmegaConf

from async_rl.core.errors import AsyncConfigError
from async_rl.demo import demo_overrides
from async_rl.rollout.cpu.engine import ContinuousBatchingEngine
from async_rl.rollout.cpu.options import ENGINE_KWARGS_KEY, CpuEngineOptions
from async_rl.rollout.cpu.registration import CPU_ROLLOUT_NAME
from async_rl.rollout.cpu.server import CPURolloutServer
from async_rl.run_config import read_run_config
from helpers.lineage import compose_ppo

TIMEOUT_S = 60
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                                      tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("tiny_qwen2_window")
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def test_requests_arriving_one_by_one_share_one_prefill(model_dir):
    window_s = 0.5
    engine = ContinuousBatchingEngine.from_pretrained(model_dir, admission_window_s=window_s)

    async def main():
        loop = asyncio.get_running_loop()
        start = loop.time()
        tasks = []
        for i in range(3):  # 30 ms apart: without a window each would run its own steps
            tasks.append(asyncio.create_task(engine.generate([1, 2, 3 + i], {**GREEDY, "max_new_tokens": 2})))
            await asyncio.sleep(0.03)
        results = await asyncio.gather(*tasks)
        elapsed = loop.time() - start
        await engine.close()
        return results, elapsed

    results, elapsed = run(main())
    assert [len(r.token_ids) for r in results] == [2, 2, 2]
    assert engine.num_steps == 2  # one prefill of all three, one decode step
    assert elapsed >= window_s  # the first waited the window for the others


def test_running_rows_decode_while_a_new_request_waits_its_window(model_dir):
    window_s = 0.3
    engine = ContinuousBatchingEngine.from_pretrained(model_dir, admission_window_s=window_s)

    async def main():
        loop = asyncio.get_running_loop()
        long_task = asyncio.create_task(engine.generate([1, 2, 3], {**GREEDY, "max_new_tokens": 4000}, "long"))
        while not engine.num_tokens("long"):
            await asyncio.sleep(0.005)
        submitted, tokens_then = loop.time(), engine.num_tokens("long")
        short = await engine.generate([4, 5, 6], {**GREEDY, "max_new_tokens": 2}, "short")
        waited, tokens_now = loop.time() - submitted, engine.num_tokens("long")
        engine.abort_all()
        await long_task
        await engine.close()
        return short, waited, None if tokens_now is None else tokens_now - tokens_then

    short, waited, decoded_meanwhile = run(main())
    assert len(short.token_ids) == 2 and decoded_meanwhile is not None  # the long row outlived the short one
    assert waited >= window_s  # admitted only once it had waited the window
    assert decoded_meanwhile > 2  # the running row kept decoding meanwhile


def test_a_full_batch_is_admitted_without_waiting(model_dir):
    engine = ContinuousBatchingEngine.from_pretrained(model_dir, admission_window_s=3600.0, max_num_seqs=3)

    async def main():
        results = await asyncio.gather(*(engine.generate([1, 2 + i], {**GREEDY, "max_new_tokens": 2})
                                         for i in range(3)))
        await engine.close()
        return results

    assert [len(r.token_ids) for r in run(main())] == [2, 2, 2]  # an hour's window would time this out


def test_without_a_window_each_request_starts_at_the_next_step(model_dir):
    engine = ContinuousBatchingEngine.from_pretrained(model_dir)

    async def main():
        first = await engine.generate([1, 2, 3], {**GREEDY, "max_new_tokens": 2})
        second = await engine.generate([1, 2, 4], {**GREEDY, "max_new_tokens": 2})
        await engine.close()
        return first, second

    run(main())
    assert engine.admission_window_s == 0 and engine.num_steps == 4


def test_the_server_reads_the_window_from_verls_rollout_config(model_dir):
    from verl.workers.config import HFModelConfig, RolloutConfig

    config = RolloutConfig(name=CPU_ROLLOUT_NAME, tensor_model_parallel_size=1, prompt_length=8, response_length=4,
                           engine_kwargs={"cpu": {"admission_window_ms": 25}})
    server = CPURolloutServer(config, HFModelConfig(path=model_dir, load_tokenizer=False), replica_rank=0)
    asyncio.run(server.launch_server())
    assert server.engine.admission_window_s == pytest.approx(0.025)


@pytest.mark.parametrize("engine_kwargs, expected", [
    (None, 0.0), ({}, 0.0), ({"vllm": {"x": 1}}, 0.0), ({"cpu": {"admission_window_ms": 30}}, 30.0),
    ({"cpu": {"admission_window_ms": "12.5"}}, 12.5),
])
def test_options_from_a_rollout_config(engine_kwargs, expected):
    config = OmegaConf.create({"engine_kwargs": engine_kwargs})
    assert CpuEngineOptions.from_rollout_config(config).admission_window_ms == expected


@pytest.mark.parametrize("cpu, key", [
    ({"admission_window": 30}, f"{ENGINE_KWARGS_KEY}.admission_window"),
    ({"admission_window_ms": -1}, f"{ENGINE_KWARGS_KEY}.admission_window_ms"),
    ({"admission_window_ms": "soon"}, f"{ENGINE_KWARGS_KEY}.admission_window_ms"),
    ({"admission_window_ms": float("inf")}, f"{ENGINE_KWARGS_KEY}.admission_window_ms"),
    (5, ENGINE_KWARGS_KEY),
])
def test_a_wrong_option_is_refused_naming_its_key(cpu, key):
    with pytest.raises(AsyncConfigError) as error:
        CpuEngineOptions.from_rollout_config(OmegaConf.create({"engine_kwargs": {"cpu": cpu}}))
    assert error.value.key == key and key in str(error.value)


def test_the_pipeline_refuses_a_wrong_option_before_ray_starts(demo_dir):
    key = f"+{ENGINE_KWARGS_KEY}.admission_window_ms"
    read_run_config(compose_ppo(demo_overrides(demo_dir, extra={key: 20})))  # the demo: CPU servers
    with pytest.raises(AsyncConfigError, match="admission_window_ms"):
        read_run_config(compose_ppo(demo_overrides(demo_dir, extra={key: -5})))


def test_verls_own_trainer_refuses_a_wrong_option_before_ray_starts(demo_dir):
    from async_rl import verl_trainer_on_cpu

    config = compose_ppo(demo_overrides(demo_dir, extra={"+actor_rollout_ref.async_pipeline": False,
                                                         f"+{ENGINE_KWARGS_KEY}.admission_window": 20}))
    assert verl_trainer_on_cpu.wants_cpu_rollout(config)
    with pytest.raises(AsyncConfigError, match="admission_window"):
        verl_trainer_on_cpu.prepare(config)
