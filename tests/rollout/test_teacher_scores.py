"""A distillation teacher on the CPU backend: the server's prompt log-probs are vLLM's layout as verl's teacher
manager reads them, the pipeline's batch lays them out as verl's agent loop pads them, and the start checks
name what the pipeline cannot serve a teacher on."""

from __future__ import annotations

import asyncio

import pytest
import torch
import transformers
from verl.workers.config import HFModelConfig, RolloutConfig

from async_rl.core.errors import AsyncConfigError
from async_rl.core.messages import Sample, build_batch
from async_rl.rollout.cpu.server import CPURolloutServer
from async_rl.rollout.teachers import check_teachers
from helpers.lineage import compose_ppo

SEQUENCE = [3, 7, 1, 12, 5, 9, 2, 14, 6]
TEACHER_PARAMS = {"max_tokens": 1, "temperature": 1.0, "detokenize": False}  # verl's _get_teacher_sampling_params


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("teacher")
    config = transformers.Qwen2Config(vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True, initializer_range=0.2)
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def served(model_dir, calls):
    """Each `calls(server)` coroutine's result, on a launched CPU server of `model_dir`."""
    config = RolloutConfig(name="cpu", tensor_model_parallel_size=1, prompt_length=16, response_length=1)
    server = CPURolloutServer(config, HFModelConfig(path=model_dir, load_tokenizer=False))

    async def main():
        await server.launch_server()
        try:
            return await calls(server)
        finally:
            await server.engine.close()

    return asyncio.run(asyncio.wait_for(main(), 60))


def reference_log_probs(model_dir) -> torch.Tensor:
    """(S - 1, vocab): the model's next-token log-probs after each token of SEQUENCE but the last."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([SEQUENCE])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_prompt_logprobs_score_each_next_token_and_the_top_k_as_vllm_lays_them_out(model_dir):
    async def calls(server):
        plain = await server.generate(SEQUENCE, TEACHER_PARAMS, "a")
        scored = await server.generate(SEQUENCE, {**TEACHER_PARAMS, "prompt_logprobs": 0}, "b")
        top = await server.generate(SEQUENCE, {**TEACHER_PARAMS, "prompt_logprobs": 3}, "c")
        return plain, scored, top

    plain, scored, top = served(model_dir, calls)
    reference = reference_log_probs(model_dir)
    assert "prompt_logprobs" not in plain.extra_fields
    # K = 0: row i is token i + 1 and its log-prob after tokens 0..i; the last row is padding
    ids, logprobs = torch.tensor(scored.extra_fields["prompt_ids"]), torch.tensor(scored.extra_fields["prompt_logprobs"])
    assert ids.shape == logprobs.shape == (len(SEQUENCE), 1)
    assert ids[:-1, 0].tolist() == SEQUENCE[1:] and ids[-1].tolist() == [0] and logprobs[-1].tolist() == [0.0]
    expected = reference.gather(-1, torch.tensor(SEQUENCE[1:]).unsqueeze(-1))
    torch.testing.assert_close(logprobs[:-1], expected, rtol=1e-5, atol=1e-5)
    # K = 3: the three most likely next tokens, most likely first
    ids, logprobs = torch.tensor(top.extra_fields["prompt_ids"]), torch.tensor(top.extra_fields["prompt_logprobs"])
    assert ids.shape == logprobs.shape == (len(SEQUENCE), 3)
    best, best_ids = reference.topk(3, dim=-1)
    assert ids[:-1].tolist() == best_ids.tolist()
    torch.testing.assert_close(logprobs[:-1], best, rtol=1e-5, atol=1e-5)
    assert len(top.token_ids) == 1  # and the one token verl's teacher request asks for


def test_verls_teacher_manager_reads_the_servers_scores(model_dir, demo_dir):
    from verl.experimental.teacher_loop.teacher_manager import AsyncTeacherLLMServerManager

    config = compose_ppo(distillation_overrides(demo_dir, model_dir))

    class ServerClient:  # verl's LLMServerClient.generate, straight onto the server
        def __init__(self, server):
            self.server = server

        async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
            return await self.server.generate(prompt_ids, sampling_params, request_id)

    async def calls(server):
        manager = AsyncTeacherLLMServerManager(config, {"default": ServerClient(server)})
        return await manager.compute_teacher_logprobs_single(sequence_ids=SEQUENCE)

    ids, logprobs = served(model_dir, calls)
    reference = reference_log_probs(model_dir)
    assert ids[:-1, 0].tolist() == SEQUENCE[1:]
    torch.testing.assert_close(logprobs[:-1].float(), reference.gather(-1, torch.tensor(SEQUENCE[1:]).unsqueeze(-1)),
                               rtol=1e-5, atol=1e-5)


def test_the_batch_lays_teacher_scores_out_as_verls_agent_loop_pads_them():
    from verl.experimental.teacher_loop.teacher_manager import _pad_teacher_outputs

    max_prompt, max_response, pad = 5, 4, 15
    shapes = [(3, 2), (5, 4), (1, 1)]  # prompt, response tokens
    samples, rows = [], []
    for i, (p, r) in enumerate(shapes):
        ids = torch.arange(100 * i, 100 * i + 2 * (p + r), dtype=torch.int32).reshape(p + r, 2)
        logprobs = -ids.float() / 1000
        rows.append((ids, logprobs, p, r))
        samples.append(Sample(uid=str(i), prompt_ids=list(range(1, p + 1)), response_ids=list(range(1, r + 1)),
                              rollout_log_probs=[0.0] * r, token_versions=[0] * r, teacher_ids=ids,
                              teacher_logprobs=logprobs))
    batch = build_batch(samples, max_prompt, max_response, pad)
    for i, (ids, logprobs, p, r) in enumerate(rows):
        verl_ids, verl_logprobs = _pad_teacher_outputs(ids, logprobs, max_prompt, max_response, p, r, pad)
        assert torch.equal(batch.batch["teacher_ids"][i], verl_ids[0])
        assert torch.equal(batch.batch["teacher_logprobs"][i], verl_logprobs[0])
    unscored = Sample(uid="x", prompt_ids=[1], response_ids=[1], rollout_log_probs=[0.0], token_versions=[0])
    with pytest.raises(ValueError, match="mixes samples scored by a distillation teacher"):
        build_batch([samples[0], unscored], max_prompt, max_response, pad)


def distillation_overrides(demo_dir, model_dir, **extra) -> list[str]:
    from async_rl.demo import demo_overrides

    keys = {"distillation.enabled": True, "distillation.nnodes": 1, "distillation.n_gpus_per_node": 1,
            "distillation.teacher_models.teacher_model.model_path": model_dir,
            "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size": 1, **extra}
    return demo_overrides(demo_dir, extra=keys)


@pytest.mark.parametrize("extra,error,match", [
    ({"distillation.teacher_models.teacher_model.inference.name": "vllm"}, AsyncConfigError,
     r"distillation.teacher_models.teacher_model.inference.name='vllm'.*the backends the pipeline serves teachers on"),
    ({"distillation.teacher_models.teacher_model.model_path": "/no/such/teacher"}, FileNotFoundError,
     r"distillation.teacher_models.teacher_model.model_path='/no/such/teacher'"),
    ({"+distillation.teacher_models.teacher_model.inference.router_config_path": "/no/such/router.yaml"},
     AsyncConfigError, r"distillation.teacher_models.teacher_model.inference.router_config_path='/no/such/router.yaml'"
                       r".*Router config file not found"),
    ({"distillation.n_gpus_per_node": 3, "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size": 2},
     AsyncConfigError, r"distillation.*must divide the distillation resource pool size"),
])
def test_what_the_pipeline_cannot_serve_a_teacher_on_is_named_before_ray(demo_dir, model_dir, extra, error, match):
    config = compose_ppo(distillation_overrides(demo_dir, model_dir, **extra))
    with pytest.raises(error, match=match):
        check_teachers(config, "cpu")
    check_teachers(compose_ppo(distillation_overrides(demo_dir, model_dir)), "cpu")  # the same run, as verl takes it
