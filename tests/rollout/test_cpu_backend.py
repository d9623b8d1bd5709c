"""Tests for the CPU rollout backend (engine, server, replica, registry) on a tiny random Qwen2."""

import asyncio

import pytest
import torch
import transformers

from async_rl.rollout.cpu.engine import ContinuousBatchingEngine
from async_rl.rollout.cpu.registration import CPU_ROLLOUT_NAME, register_cpu_rollout
from async_rl.rollout.cpu.replica import CPURolloutReplica
from async_rl.rollout.cpu.server import CPURolloutServer
from helpers.clusters import RAY_CALL_GUARD_S

TIMEOUT_S = 60


def _tiny_config(**overrides):
    kwargs = dict(
        vocab_size=16,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        initializer_range=0.2,  # wide enough that greedy outputs vary token to token
    )
    kwargs.update(overrides)
    return transformers.Qwen2Config(**kwargs)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_qwen2")
    transformers.Qwen2ForCausalLM(_tiny_config()).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def other_weights():
    """A state dict with the same shapes and different values."""
    torch.manual_seed(1)
    return transformers.Qwen2ForCausalLM(_tiny_config()).state_dict()


def run(coro, timeout=TIMEOUT_S):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def load_engine(model_dir, **kwargs):
    return ContinuousBatchingEngine.from_pretrained(model_dir, **kwargs)


def hf_greedy(model, prompt, n):
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def forward_logprobs(model, prompt, tokens, temperature=1.0):
    """log_softmax(logits / T) of a fresh unbatched forward at each generated token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


async def wait_for_tokens(engine, request_id, n):
    while (engine.num_tokens(request_id) or 0) < n:
        await asyncio.sleep(0.001)


PROMPTS = [[1, 2, 3], [7, 3, 9, 1, 2, 11], [5], [4, 4, 8, 12, 0, 3, 3, 9, 10, 2]]


def test_greedy_matches_hf_generate_in_a_mixed_batch(model_dir):
    engine = load_engine(model_dir)
    reference = [hf_greedy(engine.model, p, 12) for p in PROMPTS]
    assert len({tuple(r) for r in reference}) > 1 and len(set(reference[0])) > 1  # non-degenerate model

    async def main():
        params = [{"temperature": 0.0, "max_new_tokens": 12}, {"temperature": 0.8, "top_k": 1, "max_tokens": 12}]
        results = await asyncio.gather(
            *[engine.generate(p, params[i % 2], f"r{i}") for i, p in enumerate(PROMPTS)]
        )
        await engine.close()
        return results

    for result, ref in zip(run(main()), reference):
        assert result.token_ids == ref
        assert result.stop_reason == "length"
        assert result.token_versions == [0] * 12


def test_logprobs_equal_fresh_forward(model_dir):
    engine = load_engine(model_dir, seed=3)
    temperature = 0.7

    async def main():
        params = {"temperature": temperature, "top_p": 0.9, "top_k": 10, "max_new_tokens": 15}
        results = await asyncio.gather(*[engine.generate(p, params, f"r{i}") for i, p in enumerate(PROMPTS)])
        await engine.close()
        return results

    results = run(main())
    assert len({tuple(r.token_ids) for r in results}) == len(PROMPTS)
    for prompt, result in zip(PROMPTS, results):
        assert len(result.token_ids) == len(result.log_probs) == 15
        expected = forward_logprobs(engine.model, prompt, result.token_ids, temperature)
        assert result.log_probs == pytest.approx(expected, abs=1e-4)


def test_seeded_sampling_is_reproducible(model_dir):
    async def sample(seed):
        engine = load_engine(model_dir, seed=seed)
        result = await engine.generate([1, 2, 3], {"temperature": 1.0, "max_new_tokens": 20}, "r")
        await engine.close()
        return result.token_ids

    assert run(sample(7)) == run(sample(7))
    assert run(sample(7)) != run(sample(8))


def test_requests_join_and_leave_running_batch(model_dir):
    engine = load_engine(model_dir)
    long_ref = hf_greedy(engine.model, PROMPTS[0], 40)
    short_ref = hf_greedy(engine.model, PROMPTS[1], 8)

    async def main():
        long_task = asyncio.create_task(engine.generate(PROMPTS[0], {"temperature": 0, "max_new_tokens": 40}, "long"))
        await wait_for_tokens(engine, "long", 5)
        await engine.pause()  # so the short request is admitted at a known step boundary
        steps_before = engine.num_steps
        short_task = asyncio.create_task(engine.generate(PROMPTS[1], {"temperature": 0, "max_new_tokens": 8}, "x"))
        await asyncio.sleep(0)
        engine.resume()
        short = await short_task
        assert not long_task.done()  # the short request joined, finished and left while the long one ran
        assert engine.num_steps - steps_before == 8  # one step per token: it rode along, no extra steps
        long = await long_task
        await engine.close()
        return long, short, engine.num_steps

    long, short, steps = run(main())
    assert long.token_ids == long_ref
    assert short.token_ids == short_ref
    assert steps == 40  # 40 + 8 tokens in 40 batched steps


def test_stop_token_and_eos_end_request(model_dir):
    engine = load_engine(model_dir)
    ref = hf_greedy(engine.model, PROMPTS[1], 12)
    cut = next(i for i, t in enumerate(ref) if i > 0 and t not in ref[:i])

    async def main():
        stop_params = {"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [ref[cut]]}
        by_stop = await engine.generate(PROMPTS[1], stop_params)
        engine.eos_token_ids = frozenset({ref[cut]})
        by_eos = await engine.generate(PROMPTS[1], {"temperature": 0, "max_new_tokens": 12})
        ignored = await engine.generate(PROMPTS[1], {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
        await engine.close()
        return by_stop, by_eos, ignored

    by_stop, by_eos, ignored = run(main())
    for result in (by_stop, by_eos):
        assert result.token_ids == ref[: cut + 1]
        assert result.stop_reason == "completed"
    assert ignored.token_ids == ref and ignored.stop_reason == "length"


def test_abort_all_returns_partial_tokens(model_dir):
    engine = load_engine(model_dir)

    async def main():
        tasks = [
            asyncio.create_task(engine.generate(p, {"temperature": 1.0, "max_new_tokens": 50}, f"r{i}"))
            for i, p in enumerate(PROMPTS[:2])
        ]
        await wait_for_tokens(engine, "r0", 3)
        aborted_ids = engine.abort_all()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 1.0)  # returns at once, not after 50 tokens
        after = await engine.generate(PROMPTS[2], {"temperature": 0, "max_new_tokens": 4}, "after")
        await engine.close()
        return aborted_ids, results, after

    aborted_ids, results, after = run(main())
    assert sorted(aborted_ids) == ["r0", "r1"]
    for result in results:
        assert result.stop_reason == "aborted"
        assert 0 < len(result.token_ids) < 50
        assert len(result.log_probs) == len(result.token_versions) == len(result.token_ids)
    assert len(after.token_ids) == 4 and after.stop_reason == "length"  # engine keeps serving


def test_pause_blocks_and_resume_continues(model_dir):
    engine = load_engine(model_dir)

    async def main():
        first = asyncio.create_task(engine.generate(PROMPTS[0], {"temperature": 0, "max_new_tokens": 30}, "first"))
        await wait_for_tokens(engine, "first", 2)
        await engine.pause()
        steps, tokens = engine.num_steps, engine.num_tokens("first")
        second = asyncio.create_task(engine.generate(PROMPTS[1], {"temperature": 0, "max_new_tokens": 5}, "second"))
        await asyncio.sleep(0.3)
        assert (engine.num_steps, engine.num_tokens("first"), engine.num_tokens("second")) == (steps, tokens, 0)
        assert not first.done() and not second.done()  # waiting, not rejected
        engine.resume()
        results = await asyncio.gather(first, second)
        await engine.close()
        return results

    first, second = run(main())
    assert first.token_ids == hf_greedy(engine.model, PROMPTS[0], 30)
    assert second.token_ids == hf_greedy(engine.model, PROMPTS[1], 5)


def test_update_weights_changes_outputs_and_versions(model_dir, other_weights):
    engine = load_engine(model_dir)
    old_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    new_model = transformers.Qwen2ForCausalLM(_tiny_config())
    new_model.load_state_dict(other_weights)
    without_lm_head = [(k, v) for k, v in other_weights.items() if k != "lm_head.weight"]  # tied: aliases embed
    greedy = {"temperature": 0, "max_new_tokens": 10}

    async def main():
        before = await engine.generate(PROMPTS[1], greedy, "before")
        await engine.update_weights(without_lm_head, version=1)
        after = await engine.generate(PROMPTS[1], greedy, "after")
        # a request that spans an update: back to the first weights (as a dict, lm_head included) mid-request
        spanning = asyncio.create_task(engine.generate(PROMPTS[0], {"temperature": 1.0, "max_new_tokens": 40}, "span"))
        await wait_for_tokens(engine, "span", 3)
        await engine.update_weights(old_model.state_dict(), version=2)
        spanning = await spanning
        await engine.close()
        return before, after, spanning

    before, after, spanning = run(main())
    assert before.token_ids == hf_greedy(old_model, PROMPTS[1], 10) and before.token_versions == [0] * 10
    assert after.token_ids == hf_greedy(new_model, PROMPTS[1], 10) and after.token_versions == [1] * 10
    assert after.token_ids != before.token_ids
    assert engine.param_version == 2

    versions = spanning.token_versions
    assert versions == sorted(versions) and set(versions) == {1, 2}
    split = versions.index(2)
    # tokens before the update are scored by the weights at version 1, after it by version 2 (fresh prefill)
    expected_v1 = forward_logprobs(new_model, PROMPTS[0], spanning.token_ids)[:split]
    expected_v2 = forward_logprobs(old_model, PROMPTS[0], spanning.token_ids)[split:]
    assert spanning.log_probs == pytest.approx(expected_v1 + expected_v2, abs=1e-4)


def test_update_weights_is_all_or_nothing(model_dir, other_weights):
    engine = load_engine(model_dir)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    good = ("model.norm.weight", other_weights["model.norm.weight"])

    async def main():
        with pytest.raises(KeyError, match="model.layers.0.bogus"):
            await engine.update_weights([good, ("model.layers.0.bogus", torch.zeros(3))], version=5)
        with pytest.raises(ValueError, match="model.embed_tokens.weight"):
            await engine.update_weights([good, ("model.embed_tokens.weight", torch.zeros(3, 64))], version=5)
        await engine.close()

    run(main())
    assert engine.param_version == 0
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_server_defaults_and_abort_gate(model_dir):
    from verl.workers.config import HFModelConfig, RolloutConfig

    config = RolloutConfig(
        name=CPU_ROLLOUT_NAME, tensor_model_parallel_size=1, prompt_length=8, response_length=6, ignore_eos=True
    )
    server = CPURolloutServer(config, HFModelConfig(path=model_dir, load_tokenizer=False), replica_rank=0)

    async def main():
        await server.launch_server()
        default = await server.generate(torch.tensor(PROMPTS[1]), {"temperature": 0.0}, "a")
        clamped = await server.generate([i % 16 for i in range(60)], {"max_tokens": 100}, "b")  # max_model_len = 64
        with pytest.raises(ValueError):
            await server.generate([1] * 64, {}, "c")
        running = asyncio.create_task(server.generate(PROMPTS[0], {"max_new_tokens": 50}, "d"))
        await wait_for_tokens(server.engine, "d", 2)
        info = await server.abort_all_requests(reject_request=True)
        partial = await running
        rejected = await server.generate(PROMPTS[0], {}, "e")
        await server.resume_generation()
        resumed = await server.generate(PROMPTS[0], {}, "f")
        await server.engine.close()
        return default, clamped, info, partial, rejected, resumed

    default, clamped, info, partial, rejected, resumed = run(main())
    assert len(default.token_ids) == 6 and default.stop_reason == "completed"  # response_length
    assert default.extra_fields["token_versions"] == [0] * 6 and default.extra_fields["param_version"] == 0
    assert len(clamped.token_ids) == 4
    assert info == {"aborted_count": 1, "request_ids": ["d"]}
    assert partial.stop_reason == "aborted" and 0 < len(partial.token_ids) < 50
    assert rejected.stop_reason == "aborted" and rejected.token_ids == []
    assert len(resumed.token_ids) == 6


def test_cpu_replica_is_registered():
    from verl.workers.rollout.replica import get_rollout_replica_class

    register_cpu_rollout()
    register_cpu_rollout()  # idempotent
    assert get_rollout_replica_class("cpu") is CPURolloutReplica


@pytest.mark.parametrize("name, loader", [("vllm", "_load_vllm"), ("sglang", "_load_sglang")])
def test_builtin_backends_stay_registered(name, loader):
    """Registering 'cpu' leaves verl's own loaders in place (their selection: test_backends.py)."""
    from verl.workers.rollout import replica

    register_cpu_rollout()
    assert replica.RolloutReplicaRegistry._registry[name] is getattr(replica, loader)


def test_replica_init_standalone_and_generate_over_ray(ray_cluster, model_dir):
    import ray
    from verl.workers.config import HFModelConfig, RolloutConfig
    from verl.workers.rollout.replica import get_rollout_replica_class

    register_cpu_rollout()
    config = RolloutConfig(
        name=CPU_ROLLOUT_NAME, tensor_model_parallel_size=1, prompt_length=8, response_length=5, ignore_eos=True
    )
    model_config = HFModelConfig(path=model_dir, load_tokenizer=False)
    replica = get_rollout_replica_class(config.name)(
        replica_rank=0, config=config, model_config=model_config, gpus_per_node=1
    )
    assert not replica.rollout_worker_use_gpu()
    run(replica.init_standalone(), timeout=RAY_CALL_GUARD_S)
    handle = replica.server_handle
    assert replica.servers == [handle] and replica.server_address.count(":") == 1
    # one node: the address is loopback and the reserved port is bound there (never every interface)
    host, port = replica.server_address.split(":")
    bound = ray.get(handle.__ray_call__.remote(lambda server: server._port_socket.getsockname()), timeout=RAY_CALL_GUARD_S)
    assert host == "127.0.0.1" and tuple(bound) == (host, int(port))

    out = ray.get(handle.generate.remote(PROMPTS[1], {"temperature": 0.0}, "req-0"), timeout=RAY_CALL_GUARD_S)
    local = ContinuousBatchingEngine.from_pretrained(model_dir)
    assert out.token_ids == hf_greedy(local.model, PROMPTS[1], 5)
    assert out.log_probs == pytest.approx(forward_logprobs(local.model, PROMPTS[1], out.token_ids), abs=1e-4)
    assert out.stop_reason == "completed" and out.extra_fields["token_versions"] == [0] * 5

    state = {k: v + 0.05 for k, v in local.model.state_dict().items()}
    ray.get(handle.update_weights.remote(state, 3), timeout=RAY_CALL_GUARD_S)
    assert ray.get(handle.get_param_version.remote(), timeout=RAY_CALL_GUARD_S) == 3
    out = ray.get(handle.generate.remote(PROMPTS[1], {"temperature": 0.0}, "req-1"), timeout=RAY_CALL_GUARD_S)
    assert out.extra_fields["token_versions"] == [3] * 5
