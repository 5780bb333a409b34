#!/usr/bin/env bash
# GRPO on BIRD text-to-SQL with verl driving arctic-platform's engines (Qwen3-0.6B, one GPU box).
#
# Same shape as run_gsm8k_grpo_arl.sh: verl keeps its loop, rewards and advantages; an
# `arctic-platform serve` process launched by the verl driver runs generation and training.
# Longer prompts (schemas) and 16 samples per question; validation every 4 steps.
#
# Requirements (a GPU machine):
#   pip install torch                       # your CUDA build
#   pip install "arctic-platform[verl]"
#   pip install <a verl with verl.remote_backend>   # verl-project/verl PR #7102 (V1 trainer)
#   BIRD prepared as verl parquet files in $DATA_DIR (train.parquet, val.parquet), and a reward
#   function file $BIRD_REWARD defining compute_score(data_source, solution_str, ground_truth,
#   extra_info) that executes the predicted SQL against the BIRD databases.
#
# Any Hydra override can be appended: ./run_bird_grpo_arl.sh trainer.total_training_steps=20
set -euo pipefail

export PYTHONUNBUFFERED=1
export HYDRA_FULL_ERROR=1
# The plugin: registers the `arctic` remote backend and rollout replica in every verl process.
export VERL_USE_EXTERNAL_MODULES=arctic_platform.integrations.verl.register

DATA_DIR=${DATA_DIR:-$HOME/data/bird}
BIRD_REWARD=${BIRD_REWARD:?set BIRD_REWARD to the file defining compute_score for BIRD}
MODEL=${MODEL:-Qwen/Qwen3-0.6B}
ENGINE_GPUS=${ENGINE_GPUS:-1}

# `remote_backend=arctic`, or `+remote_backend=arctic` on a verl whose defaults lack the group.
SELECT_ARCTIC=$(python3 -m arctic_platform.integrations.verl.hydra_group)

python3 -m verl.trainer.main_ppo \
    hydra.searchpath="[pkg://arctic_platform.integrations.verl.config]" \
    "$SELECT_ARCTIC" \
    remote_backend.arctic.backend=http \
    remote_backend.arctic.http.device=cuda \
    remote_backend.arctic.http.data_dir="$PWD/arctic-data" \
    remote_backend.arctic.training.n_gpus="$ENGINE_GPUS" \
    remote_backend.arctic.sampling.n_gpus="$ENGINE_GPUS" \
    remote_backend.arctic.training.attn_implementation=sdpa \
    remote_backend.arctic.training.max_tokens_per_microbatch=32768 \
    remote_backend.arctic.device_peak_tflops=989 \
    algorithm.adv_estimator=grpo \
    algorithm.norm_adv_by_std_in_grpo=True \
    algorithm.use_kl_in_reward=False \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/val.parquet" \
    data.train_batch_size=8 \
    data.max_prompt_length=4096 \
    data.max_response_length=2048 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    data.shuffle=False \
    reward.custom_reward_function.path="$BIRD_REWARD" \
    reward.custom_reward_function.name=compute_score \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.data_loader_seed=42 \
    actor_rollout_ref.rollout.name=arctic \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.n=16 \
    actor_rollout_ref.rollout.temperature=1.0 \
    actor_rollout_ref.rollout.max_num_seqs=128 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.rollout.agent.num_workers=1 \
    actor_rollout_ref.rollout.checkpoint_engine.backend=naive \
    actor_rollout_ref.rollout.val_kwargs.temperature=0 \
    actor_rollout_ref.rollout.val_kwargs.do_sample=False \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    trainer.critic_warmup=0 \
    trainer.logger="['console']" \
    trainer.project_name=arctic_platform_verl \
    trainer.experiment_name=bird_grpo_qwen3_0p6b \
    trainer.val_before_train=True \
    trainer.save_freq=-1 \
    trainer.test_freq=4 \
    trainer.total_training_steps=4 \
    trainer.total_epochs=1 \
    "$@"
