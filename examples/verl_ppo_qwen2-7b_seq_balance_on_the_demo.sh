#!/usr/bin/env bash
# verl's examples/ppo_trainer/run_qwen2-7b_seq_balance.sh (PPO: gae with a critic) with the async
# pipeline's flag, and only the model, data, sizes and hardware changed to this project's CPU demo
# (prepare it first: `python -m async_rl.demo prepare --output-dir demo_run`). With
# `actor_rollout_ref.async_pipeline=False` as an extra argument (no `+`: it overrides the flag
# this script adds) verl's own synchronous trainer runs it on CPU.
# Extra arguments go to verl, as in verl's script. One key is renamed: verl's script sets
# critic.model.fsdp_config.{param,optimizer}_offload, which verl 0.9.1's own config no longer has
# (hydra refuses it, with or without the flag); its place is critic.fsdp.*.
set -x
DEMO_DIR="$(realpath "${DEMO_DIR:-demo_run}")"

train_files="['$DEMO_DIR/data/train.parquet']"
test_files="['$DEMO_DIR/data/val.parquet']"

# For async rollout mode, dataset should return raw chat.
rollout_mode="async"
return_raw_chat="True"

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=gae \
    data.train_files="$train_files" \
    data.val_files="$test_files" \
    data.return_raw_chat=$return_raw_chat \
    data.train_batch_size=256 \
    data.max_prompt_length=16 \
    data.max_response_length=4 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path="$DEMO_DIR/model" \
    actor_rollout_ref.actor.optim.lr=3e-4 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192 \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.name=cpu \
    actor_rollout_ref.rollout.mode=$rollout_mode \
    actor_rollout_ref.rollout.multi_turn.format=hermes \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=8192 \
    critic.optim.lr=1e-3 \
    critic.model.use_remove_padding=True \
    critic.model.path="$DEMO_DIR/model" \
    critic.model.enable_gradient_checkpointing=True \
    critic.ppo_max_token_len_per_gpu=8192 \
    critic.fsdp.param_offload=False \
    critic.fsdp.optimizer_offload=False \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console","file"]' \
    trainer.project_name='verl_example_gsm8k' \
    trainer.experiment_name='qwen2-7b_function_rm_bsz8k_p4k_r4k_seq_packing' \
    trainer.n_gpus_per_node=2 \
    trainer.val_before_train=False \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 \
    reward.custom_reward_function.path="$DEMO_DIR/reward.py" \
    trainer.device=cpu \
    actor_rollout_ref.actor.strategy=fsdp2 \
    actor_rollout_ref.ref.strategy=fsdp2 \
    critic.strategy=fsdp2 \
    actor_rollout_ref.actor.use_torch_compile=False \
    actor_rollout_ref.ref.use_torch_compile=False \
    critic.fsdp.use_torch_compile=False \
    +actor_rollout_ref.model.override_config.attn_implementation=sdpa \
    +critic.model.override_config.attn_implementation=sdpa \
    +actor_rollout_ref.actor.fsdp_config.mixed_precision='{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}' \
    +actor_rollout_ref.ref.fsdp_config.mixed_precision='{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}' \
    +critic.fsdp.mixed_precision='{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}' \
    +actor_rollout_ref.async_pipeline=True "$@"
