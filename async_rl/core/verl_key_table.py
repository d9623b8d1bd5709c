"""Every key of verl 0.9.1's PPO config and what the pipeline does with it, as a table: one row per
subtree, the longest matching prefix wins (`row_for`). `tests/core/test_verl_key_table.py` fails when a key
of verl's config (`verl/trainer/config/_generated_ppo_trainer.yaml`) has no row, so a new verl key is
decided, not ignored. The refusals themselves are `async_rl/core/verl_keys.py` UNSUPPORTED.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Handling(enum.Enum):
    VERL = "applied by verl's own classes, built from the command's section unchanged"  # workers, servers, loops, dataset
    PIPELINE = "read and applied by the pipeline, as verl's trainer does"
    REPLACED = "done the pipeline's own way; the log says so when the command sets it"  # never changes what is trained
    NO_EFFECT = "changes nothing that is trained, with the flag or without"  # names, tags, keys only a refused key enables
    REFUSED = "not honoured: a value other than verl's default is refused before Ray starts (verl_keys.UNSUPPORTED)"


@dataclass(frozen=True)
class KeyRow:
    prefix: str  # a key or a subtree of verl's config
    handling: Handling
    where: str  # who applies it, or why it is refused / replaced


V, P, R, N, X = Handling.VERL, Handling.PIPELINE, Handling.REPLACED, Handling.NO_EFFECT, Handling.REFUSED
ARR = "actor_rollout_ref"
WORKER_PROFILER = ("verl's worker profiler: each stage brackets its worker group's work for a step of "
                   "global_profiler.steps (async_rl/training/profiling.py)")


def switched(prefix: str, switch: str, why: str) -> tuple[KeyRow, KeyRow]:
    """A subtree that acts only when its `switch` key is set: the switch refused (`why`), the rest no effect."""
    return KeyRow(prefix, N, f"acts only with {prefix}.{switch}"), KeyRow(f"{prefix}.{switch}", X, why)


VERL_KEYS = (
    # the actor, ref and critic workers: verl's engine workers built from their sections
    KeyRow(f"{ARR}.actor", V, "verl's actor worker and its losses (async_rl/training/worker_groups.py)"),
    KeyRow(f"{ARR}.actor.ppo_mini_batch_size", P, "async_rl/training/engine_calls.py"),
    KeyRow(f"{ARR}.actor.ppo_epochs", P, "async_rl/training/engine_calls.py"),
    KeyRow(f"{ARR}.actor.shuffle", P, "async_rl/training/engine_calls.py"),
    KeyRow(f"{ARR}.actor.data_loader_seed", P, "async_rl/training/engine_calls.py"),
    KeyRow(f"{ARR}.actor.calculate_entropy", P, "async_rl/training/engine_calls.py"),
    KeyRow(f"{ARR}.actor.optim.total_training_steps", P, "set to the run's steps, as verl does (run_config.py)"),
    KeyRow(f"{ARR}.actor.calculate_sum_pi_squared", X, "only the optimal token baselines read it, and they are refused"),
    KeyRow(f"{ARR}.actor.use_prefix_grouper", P, "whole prompt groups per rank in trainer.balance_batch, as verl's "
           "trainer balances (async_rl/core/balance.py)"),
    KeyRow(f"{ARR}.actor.profiler", V, WORKER_PROFILER),
    KeyRow(f"{ARR}.ref", V, "verl's ref worker (state_machines/ref_logp.py)"),
    KeyRow(f"{ARR}.ref.profiler", V, WORKER_PROFILER),
    KeyRow("critic", V, "verl's critic worker and value loss (async_rl/training/worker_groups.py)"),
    KeyRow("critic.enable", P, "async_rl/core/config.py critic_enabled"),
    KeyRow("critic.ppo_mini_batch_size", P, "async_rl/training/engine_calls.py"),
    KeyRow("critic.ppo_epochs", P, "async_rl/training/engine_calls.py"),
    KeyRow("critic.shuffle", P, "async_rl/training/engine_calls.py"),
    KeyRow("critic.data_loader_seed", P, "async_rl/training/engine_calls.py"),
    KeyRow("critic.ppo_max_token_len_per_gpu", P, "the critic engine's token budget (worker_groups.py)"),
    KeyRow("critic.optim.total_training_steps", P, "set to the run's steps, as verl does (run_config.py)"),
    KeyRow("critic.profiler", V, WORKER_PROFILER),
    KeyRow("critic.model.lora", N, "Megatron's LoRA; the FSDP critic reads critic.model.lora_rank"),
    *(KeyRow(f"critic.model.{k}", X, "verl 0.9.1's FSDP engine cannot build a LoRA value model (PEFT's causal-LM "
             "adapter on a token-classification model: no prepare_inputs_for_generation)")
      for k in ("lora_rank", "lora_adapter_path")),
    KeyRow(f"{ARR}.hybrid_engine", N, "verl's colocated trainer; the pipeline places its stages apart"),
    KeyRow(f"{ARR}.nccl_timeout", N, "nothing in verl 0.9.1 reads it"),
    # the model: verl's HFModelConfig in every worker, server and agent loop; the pipeline's tokenizer too
    KeyRow(f"{ARR}.model", V, "verl's HFModelConfig (also the pipeline's tokenizer: async_rl/core/prompts.py)"),
    KeyRow(f"{ARR}.model.lora_rank", V, "LoRA: versions carry the adapter, which the CPU backend merges and "
           "vLLM serves as an adapter (param_update/lora.py); SGLang refused (async_rl/core/verl_keys.py)"),
    KeyRow(f"{ARR}.model.lora", N, "Megatron's LoRA; FSDP reads actor_rollout_ref.model.lora_rank"),
    KeyRow(f"{ARR}.model.lora.merge", R, "the pipeline sends the adapter alone: the CPU backend merges it into "
           "its weights, vLLM serves it as an adapter; the policy served is the same"),
    KeyRow(f"{ARR}.model.lora.rank", X, "Megatron's LoRA rank, which the FSDP engine does not read: set "
           "actor_rollout_ref.model.lora_rank"),
    KeyRow(f"{ARR}.model.lora.adapter_path", X, "Megatron's adapter path, which the FSDP engine does not read: set "
           "actor_rollout_ref.model.lora_adapter_path"),
    # the rollout: verl's servers (vllm, sglang) and agent loops read it; the CPU backend reads its sampling
    KeyRow(f"{ARR}.rollout", V, "verl's rollout servers and agent loops (async_rl/rollout); the CPU backend: "
           "sampling, lengths, seed, multi_turn and agent keys"),
    KeyRow(f"{ARR}.rollout.name", P, "the rollout backend (async_rl/api/rollout.py)"),
    KeyRow(f"{ARR}.rollout.n", P, "responses per prompt (state_machines/generate.py)"),
    KeyRow(f"{ARR}.rollout.val_kwargs.n", P, "async_rl/validation.py"),
    KeyRow(f"{ARR}.rollout.calculate_log_probs", R, "always on: every request asks for its tokens' log-probs, which "
           "decoupled PPO trains on"),
    KeyRow(f"{ARR}.rollout.checkpoint_engine", R, "the pipeline's five-part weight sync moves the weights"),
    KeyRow(f"{ARR}.rollout.agent.num_workers", R, "the generate stage runs the agent loops itself"),
    KeyRow(f"{ARR}.rollout.nnodes", P, "verl's standalone rollout nodes: generation on nodes of its own after the "
           "trainer's (async_rl/core/verl_async_keys.py standalone_rollout)"),
    KeyRow(f"{ARR}.rollout.n_gpus_per_node", P, "with rollout.nnodes > 0: must equal trainer.n_gpus_per_node "
           "(async_rl/core/verl_async_keys.py standalone_rollout)"),
    KeyRow(f"{ARR}.rollout.full_determinism", P, "verl's determinism environment in every process "
           "(async_rl/run_config.py determinism_env); verl's agent loops read the key itself"),
    KeyRow(f"{ARR}.rollout.router_config_path", P, "the user's load balancer, built by verl's get_router_handle, "
           "chooses the replica of each agent-loop turn (async_rl/rollout/routing.py)"),
    KeyRow(f"{ARR}.rollout.enable_rollout_routing_replay", X, "routed experts are not carried to the trainer"),
    KeyRow(f"{ARR}.rollout.moe_load_balance_metrics_interval", X, "the pipeline does not log verl's MoE metrics"),
    *(KeyRow(f"{ARR}.rollout.{k}", X, "a quantized rollout (verl's fp8 on vLLM / SGLang GPUs) and its weight load "
             "are not built or tested under the flag") for k in ("quantization", "quantization_config_file")),
    *switched(f"{ARR}.rollout.disaggregation", "enabled", "prefill/decode pairs need vLLM / SGLang on GPUs with KV "
              "transfer; the pipeline starts plain replicas"),
    *switched(f"{ARR}.rollout.profiler", "enable", "the generate stage serves several steps' requests at once, so a "
              "rollout server has no window of one step to profile; +trainer.async_trace_path writes the pipeline's "
              "timeline"),
    KeyRow(f"{ARR}.rollout.prometheus", V, "verl's update_prometheus_config (port, file) and verl's vLLM server "
           "(served_model_name)"),
    KeyRow(f"{ARR}.rollout.prometheus.enable", P, "the rollout servers become Prometheus's scrape targets once up "
           "(async_rl/rollout/verl_replicas.py announce_to_prometheus); vLLM only"),
    KeyRow(f"{ARR}.rollout.trace", V, "verl's rollout trace (weave, mlflow, trackio): verl's agent-loop worker sets it "
           "up in the generate stage, a span per trajectory and per request (async_rl/rollout/agent_loops.py)"),
    KeyRow(f"{ARR}.rollout.multi_turn.enable", N, "nothing on main_ppo's path reads it in verl 0.9.1"),
    # data: verl's RLHFDataset and sampler (async_rl/core/prompts.py)
    KeyRow("data", V, "verl's RLHFDataset and sampler (async_rl/core/prompts.py)"),
    KeyRow("data.train_files", P, "state_machines/dataloader.py (checked before Ray)"),
    KeyRow("data.val_files", P, "async_rl/validation.py (checked before Ray)"),
    KeyRow("data.train_batch_size", P, "prompts per step (state_machines/dataloader.py)"),
    KeyRow("data.train_max_samples", P, "the dataset's cap and the run's step count (run_config.py)"),
    KeyRow("data.val_max_samples", P, "the validation set's cap, passed to verl's create_rl_dataset as verl's "
           "trainer passes it (async_rl/core/prompts.py)"),
    KeyRow("data.dataloader_num_workers", P, "run_config.py: 0 unless the command names it"),
    KeyRow("data.gen_batch_size", R, "the pipeline draws data.train_batch_size prompts per generation batch; "
           "dynamic sampling draws more batches until a step's batch is full"),
    KeyRow("data.val_batch_size", R, "validation sends the whole set to the replicas at once"),
    KeyRow("data.validation_shuffle", N, "the order validation runs in; its scores' means do not depend on it"),
    KeyRow("data.image_key", P, "the images of a row, through verl's dataset and agent loops to the rollout "
           "servers and the engines' multi_modal_inputs; refused at start on a backend that takes no images "
           "(async_rl/run_config.py refused_media)"),
    *(KeyRow(f"data.{k}", P, "a data file with this column is refused at start: text and image prompts only "
             "(async_rl/run_config.py refused_media)") for k in ("video_key", "audio_key")),
    KeyRow("data.reward_fn_key", N, "verl 0.9.1's reward managers read data_source, as the reward stage does"),
    KeyRow("data.tokenizer", N, "nothing in verl 0.9.1 reads it"),
    KeyRow("data.return_raw_input_ids", N, "nothing in verl 0.9.1 reads it"),
    KeyRow("data.trust_remote_code", N, "nothing in verl 0.9.1 reads it (actor_rollout_ref.model.trust_remote_code)"),
    # reward
    KeyRow("reward", N, "dataclass tags"),
    KeyRow("reward.custom_reward_function", P, "async_rl/core/scoring.py (verl's get_custom_reward_fn)"),
    KeyRow("reward.reward_manager", P, "naive and dapo: async_rl/core/scoring.py; any other manager, registered or "
           "from a file (source=importlib, module.path), through verl's reward loop (async_rl/core/reward_loop_scoring.py)"),
    KeyRow("reward.num_workers", R, "the reward stage scores, off the critical path"),
    KeyRow("reward.reward_model", V, "verl's reward-model replicas (rollout.name=cpu, or vllm on devices of its "
           "own) and router, started by "
           "async_rl/rollout/reward_models.py; verl's RewardLoopWorker scores (async_rl/core/reward_loop_scoring.py)"),
    KeyRow("reward.reward_model.enable", P, "the run starts the reward model (async_rl/build.py)"),
    *(KeyRow(f"reward.reward_model.{k}", P, "how many replicas and, on vllm, its devices: "
             "async_rl/rollout/reward_models.py")
      for k in ("enable_resource_pool", "n_gpus_per_node", "nnodes")),
    KeyRow("reward.sandbox_fusion", P, "verl's reward loop passes it to default_compute_score "
           "(async_rl/core/reward_loop_scoring.py)"),
    # the legacy top-level keys, mapped onto reward.* as verl's fully-async trainer maps them (logged)
    *(KeyRow(k, P, "verl's migrate_legacy_reward_impl maps it onto reward.* (async_rl/core/legacy_reward_keys.py)")
      for k in ("custom_reward_function", "reward_model", "sandbox_fusion")),
    # algorithm: state_machines/actor_train.py (verl's compute_advantage, apply_kl_penalty), decoupled PPO
    KeyRow("algorithm", P, "state_machines/actor_train.py: verl's compute_advantage and apply_kl_penalty"),
    KeyRow("algorithm.rollout_correction", P, "async_rl/core/decoupled_ppo.py: the user's own, else AReaL's"),
    KeyRow("algorithm.filter_groups", P, "the dynamic_sampling stage"),
    KeyRow("algorithm.filter_groups.max_inflight_gen_batches", R, "+trainer.generate_ahead_steps bounds the "
           "batches in flight"),
    KeyRow("distillation", V, "verl's DistillationConfig: the teachers' replicas (async_rl/rollout/teachers.py), "
           "verl's agent loops scoring each trajectory with its teacher, verl's distillation loss on the train ranks"),
    KeyRow("distillation.enabled", P, "the run starts the teachers (async_rl/rollout/teachers.py) and trains with "
           "verl's distillation loss (async_rl/training/engine_calls.py)"),
    # trainer
    KeyRow("trainer", P, "the pipeline's loop (async_rl/loop.py), checkpoints (async_rl/checkpoints.py), placement"),
    *(KeyRow(f"trainer.{k}", P, "verl's Tracking, with the run's names and backends, as verl's trainer "
             "(async_rl/pipeline.py); the names also in trainer.default_local_dir's default")
      for k in ("project_name", "experiment_name", "logger")),
    KeyRow("trainer.use_v1", N, "chooses verl's trainer; the flag runs the pipeline instead of either"),
    KeyRow("trainer.v1", R, "verl's v1 trainer modes: the pipeline is the async trainer"),
    KeyRow("trainer.v1.sampler", X, "verl's V1 replay buffer and its sampler class: the pipeline has no replay buffer; "
           "it bounds staleness by +trainer.generate_ahead_steps"),
    KeyRow("trainer.v1.sampler.max_off_policy_threshold", P, "the most policy versions a trajectory may span, set "
           "away from verl's default: +trainer.generate_ahead_steps lowered to it (async_rl/core/verl_async_keys.py "
           "versions_spanned_bound)"),
    KeyRow("trainer.v1.sampler.max_off_policy_strategy", R, "drop and wait alike: the generate stage admits no batch "
           "beyond the bound, so no trajectory is dropped or waited for"),
    KeyRow("trainer.v1.sampler.sync_refill_failed_groups", R, "verl's sync sampling only, a no-op in its async modes; "
           "the pipeline is an async trainer (a failed reward: reward.on_error)"),
    KeyRow("trainer.ray_wait_register_center_timeout", N, "a wait of verl's legacy trainer"),
    KeyRow("trainer.log_val_generations", P, "async_rl/validation.py: verl's _maybe_log_val_generations to the "
           "trainer.logger backends that take generations"),
    KeyRow("trainer.esi_redundant_time", P, "async_rl/checkpoints.py: verl's should_save_ckpt_esi saves early"),
    KeyRow("trainer.checkpoint_callback_class", P, "async_rl/checkpoints.py: verl's CheckpointCallback.on_save once "
           "a checkpoint is committed (trainer=None: there is no verl trainer object)"),
    KeyRow("trainer.max_critic_ckpt_to_keep", P, "async_rl/checkpoints.py: equal to max_actor_ckpt_to_keep (a step's "
           "actor and critic files rotate together)"),
    KeyRow("trainer.default_hdfs_dir", X, "checkpoints are saved to trainer.default_local_dir only (verl 0.9.1's FSDP "
           "checkpoint manager does not copy to it either: its hdfs_path is unused)"),
    KeyRow("global_profiler", V, "verl's profiler settings, read by verl's workers through each role's profiler"),
    *(KeyRow(f"global_profiler.{k}", P, "the steps each worker group's profiler window records "
             "(async_rl/training/profiling.py)") for k in ("steps", "profile_continuous_steps")),
    *(KeyRow(f"global_profiler.global_tool_config.nsys.{k}", N, "verl's trainer runs its processes under nsys with "
             "them, only with tool=nsys, which is refused") for k in ("controller_nsight_options", "worker_nsight_options")),
    KeyRow("global_profiler.global_tool_config.precision_debugger.steps", N, "only verl's precision debugger reads it "
           "(tool=precision_debugger, refused)"),
    *(KeyRow(f"global_profiler.global_tool_config.torch_memory.{k}", N, "nothing in verl 0.9.1 reads it")
      for k in ("context", "stacks", "kw_args")),
    KeyRow("skip", N, "acts only with skip.*.enable"),
    KeyRow("skip.rollout", P, "the generate stage dumps and replays a listed step's agent-loop output through "
           "verl's RolloutSkip (async_rl/rollout/rollout_dumps.py)"),
    KeyRow("skip.rollout_tq.enable", X, "the V1 trainer's TransferQueue dump format; under the flag skip.rollout.* "
           "dumps and replays the agent loop's output"),
    KeyRow("transfer_queue", R, "stage data moves through Ray's object store"),
    KeyRow("ray_kwargs", P, "ray.init's arguments (run_config.py)"),
    KeyRow("ray_kwargs.timeline_json_file", P, "ray.timeline once the run trained, as verl's run_ppo "
           "(async_rl/pipeline.py); +trainer.async_trace_path writes the pipeline's own timeline"),
)


def row_for(key: str) -> KeyRow | None:
    """The row of `key` (dotted): the longest prefix of it in VERL_KEYS, or None."""
    best = None
    for row in VERL_KEYS:
        if (key == row.prefix or key.startswith(row.prefix + ".")) and (best is None or len(row.prefix) > len(best.prefix)):
            best = row
    return best
