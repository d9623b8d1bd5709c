#!/usr/bin/env bash
# verl's examples/grpo_trainer/run_qwen2-7b.sh with the async pipeline's flag, and only the
# model, data, sizes and hardware changed to this project's CPU demo (prepare it first:
# `python -m async_rl.demo prepare --output-dir demo_run`). Checkpoints every save_freq steps;
# kill it at any moment and run it again: trainer.resume_mode=auto (verl's default) goes on
# from the newest checkpoint. Extra arguments go to verl, as in verl's script.
set -x
DEMO_DIR="$(realpath "${DEMO_DIR:-demo_run}")"

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$DEMO_DIR/data/train.parquet" \
    data.val_files="$DEMO_DIR/data/val.parquet" \
    data.train_batch_size=32 \
    data.max_prompt_length=16 \
    data.max_response_length=4 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path="$DEMO_DIR/model" \
    actor_rollout_ref.actor.optim.lr=3e-4 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.name=cpu \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console","file"]' \
    trainer.project_name='verl_grpo_example_gsm8k' \
    trainer.experiment_name='qwen2_7b_function_rm' \
    trainer.n_gpus_per_node=2 \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 \
    reward.custom_reward_function.path="$DEMO_DIR/reward.py" \
    trainer.device=cpu \
    actor_rollout_ref.actor.strategy=fsdp2 \
    actor_rollout_ref.ref.strategy=fsdp2 \
    actor_rollout_ref.actor.use_torch_compile=False \
    actor_rollout_ref.ref.use_torch_compile=False \
    +actor_rollout_ref.model.override_config.attn_implementation=sdpa \
    +actor_rollout_ref.actor.fsdp_config.mixed_precision='{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}' \
    +actor_rollout_ref.ref.fsdp_config.mixed_precision='{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}' \
    +actor_rollout_ref.async_pipeline=True "$@"
