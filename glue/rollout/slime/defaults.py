"""Every argument slime's own parser defines (slime/utils/arguments.py, its groups in order, and the Megatron-LM
ones it redefines with its own default: --lr 1e-6, --seed 1234, --micro-batch-size 1, ...) with slime's default,
the base of the `args` namespace slime's functions receive (glue.rollout.slime.adapter.slime_args); the run's own
values go over it. `derive` fills what slime's argument check derives from others when they are left unset.
Megatron-LM's and SGLang's arguments are not listed: the namespace carries the few SGLang ones functions read."""
from __future__ import annotations

from typing import Any

SLIME_DEFAULTS: dict[str, Any] = {
    # cluster
    "actor_num_nodes": 1, "actor_num_gpus_per_node": 8, "rollout_num_gpus": None, "rollout_num_gpus_per_engine": 1,
    "num_gpus_per_node": 8, "colocate": False, "offload": False, "offload_train": None, "offload_rollout": None,
    "distributed_backend": "nccl", "distributed_timeout_minutes": 10,
    # train
    "qwen_gdn_backend": "fla", "train_env_vars": {}, "update_weight_mode": "full", "update_weight_transport": "nccl",
    "release_train": False, "update_weight_disk_dir": None, "update_weight_disk_keep_files": False,
    "update_weight_delta_encoding": "xor", "update_weight_delta_checksum": "xxh3-128",
    "custom_update_weight_post_write_path": None, "update_weight_local_checkpoint_dir": None,
    "custom_model_provider_path": None, "recompute_loss_function": False, "log_probs_chunk_size": -1,
    "only_train_params_name_list": None, "freeze_params_name_list": None, "freeze_indexer": False,
    "allgather_cp": False,
    # rollout
    "hf_checkpoint": None, "model_name": None,
    "rollout_function_path": "slime.rollout.sglang_rollout.generate_rollout", "rollout_temperature": 1.0,
    "rollout_top_p": 1.0, "rollout_top_k": -1, "rollout_max_context_len": None, "rollout_max_prompt_len": None,
    "rollout_max_response_len": None, "rollout_skip_special_tokens": False, "rollout_stop": None,
    "rollout_stop_token_ids": None, "rollout_shuffle": False, "rollout_seed": 42, "over_sampling_batch_size": None,
    "dynamic_sampling_filter_path": None, "partial_rollout": False, "mask_offpolicy_in_partial_rollout": False,
    "custom_generate_function_path": None, "rollout_sample_hook_path": [], "custom_rollout_log_function_path": None,
    "custom_eval_rollout_log_function_path": None, "buffer_filter_path": None,
    "update_weight_buffer_size": 512 * 1024**2, "update_weights_interval": 1, "keep_old_actor": False,
    "rollout_data_postprocess_path": None, "rollout_data_transport": "object-store",
    "rollout_external_engine_addrs": None,
    # fault_tolerance
    "use_fault_tolerance": False, "rollout_health_check_interval": 30.0, "rollout_health_check_timeout": 30.0,
    "rollout_health_check_first_wait": 0,
    # data
    "num_rollout": None, "num_epoch": None, "rollout_global_dataset": True,
    "data_source_path": "slime.rollout.data_source.RolloutDataSourceWithBuffer", "prompt_data": None,
    "apply_chat_template": False, "apply_chat_template_kwargs": {}, "input_key": "input", "label_key": None,
    "multimodal_keys": None, "metadata_key": "metadata", "tool_key": "tools", "start_rollout_id": None,
    "rollout_batch_size": None, "n_samples_per_prompt": 1, "global_batch_size": None, "num_steps_per_rollout": None,
    "micro_batch_size": 1, "balance_data": False, "balance_by_flops": False, "use_dynamic_batch_size": False,
    "max_tokens_per_gpu": None, "log_probs_max_tokens_per_gpu": None,
    # eval
    "eval_function_path": None, "eval_interval": None, "eval_prompt_data": None, "eval_config": None,
    "skip_eval_before_train": False, "eval_input_key": None, "eval_label_key": None, "eval_tool_key": None,
    "n_samples_per_eval_prompt": 1, "eval_temperature": None, "eval_top_p": None, "eval_top_k": None,
    "eval_max_response_len": None, "eval_max_prompt_len": None, "eval_min_new_tokens": None,
    "eval_max_context_len": None,
    # algo
    "ref_load": None, "ref_ckpt_step": None, "load": None, "save": None, "save_interval": None, "async_save": False,
    "no_save_optim": False, "save_hf": None, "seed": 1234, "clip_grad": 1.0, "calculate_per_token_loss": False,
    "lr": 1e-06, "num_critic_only_steps": 0, "megatron_config_path": None, "eps_clip": 0.2, "eps_clip_high": None,
    "eps_clip_c": None, "value_clip": 0.2, "kl_coef": 0.0, "loss_type": "policy_loss",
    "custom_loss_function_path": None, "kl_loss_type": "k1", "advantage_estimator": "grpo",
    "compute_advantages_and_returns": True, "custom_advantage_function_path": None, "use_kl_loss": False,
    "kl_loss_coef": 0.0, "use_unbiased_kl": False, "ref_update_interval": None, "entropy_coef": 0.0, "gamma": 1.0,
    "lambd": 1.0, "normalize_advantages": False, "grpo_std_normalization": True, "rewards_normalization": True,
    "use_rollout_entropy": False, "get_mismatch_metrics": False, "reset_optimizer_states": False,
    "use_stateless_adam": False, "use_rollout_logprobs": False, "use_tis": False, "tis_clip": 2.0, "tis_clip_low": 0,
    "custom_tis_function_path": None, "custom_pg_loss_reducer_function_path": None, "use_routing_replay": False,
    "use_rollout_routing_replay": False, "use_opsm": False, "opsm_delta": 0.0001,
    # on_policy_distillation
    "use_opd": False, "opd_type": None, "opd_kl_coef": 1.0, "opd_teacher_load": None, "opd_teacher_ckpt_step": None,
    # wandb
    "use_wandb": False, "wandb_mode": None, "wandb_dir": None, "wandb_key": None, "wandb_host": None,
    "wandb_team": None, "wandb_group": None, "wandb_project": None, "wandb_random_suffix": True,
    "wandb_always_use_train_step": False, "log_multi_turn": False, "log_passrate": False, "log_reward_category": None,
    "log_correct_samples": False, "wandb_run_id": None,
    # tensorboard
    "use_tensorboard": False, "tb_project_name": None, "tb_experiment_name": None,
    # debug
    "save_debug_rollout_data": None, "load_forge_rollout_data": None, "load_debug_rollout_data_subsample": None,
    "save_debug_train_data": None, "dump_details": None, "memory_snapshot_dir": ".",
    "memory_snapshot_num_steps": None, "profile_target": ["train_overall"], "memory_recorder": "torch",
    "record_memory_history": False, "check_weight_update_equal": False,
    # network
    "http_proxy": None, "use_distributed_post": False,
    # reward_model
    "rm_type": None, "reward_key": None, "eval_reward_key": None, "group_rm": False, "rm_url": None,
    "custom_rm_path": None, "custom_reward_post_process_path": None,
    "custom_convert_samples_to_train_data_path": None,
    # rollout_buffer
    "rollout_buffer_url": None, "fetch_trajectory_retry_times": -1, "min_batch_collection_ratio": 1,
    "rollout_task_type": "math", "loss_mask_type": "qwen", "data_pad_size_multiplier": 128,
    "rollout_sample_filter_path": None, "rollout_all_samples_process_path": None,
    # custom_megatron_plugins
    "custom_megatron_init_path": None, "custom_megatron_before_log_prob_hook_path": None,
    "custom_megatron_before_train_step_hook_path": None, "megatron_deepgemm_forward_layers": None,
    "megatron_deepgemm_forward_modules": None, "megatron_deepgemm_moe_forward_layers": None,
    "megatron_deepgemm_moe_forward_modules": None,
    # mtp_training
    "mtp_num_layers": None, "mtp_loss_scaling_factor": 0.2, "enable_mtp_training": False,
    # ci
    "ci_test": False, "ci_disable_kl_checker": False, "ci_train_rollout_logprob_abs_diff_threshold": 0.1,
    "ci_save_grad_norm": None, "ci_load_grad_norm": None,
    # mode
    "train_backend": "megatron", "debug_rollout_only": False, "debug_train_only": False,
    "load_debug_rollout_data": None,
    # other
    "custom_config_path": None, "padded_vocab_size": None,
}
# slime's SGLang arguments (slime/backends/sglang_utils/arguments.py) that functions read; SGLang's own server
# options, which slime takes as --sglang-<option>, keep SGLang's defaults (sglang_dp_size: its dp_size)
SGLANG_DEFAULTS: dict[str, Any] = {
    "sglang_router_ip": None, "sglang_router_port": None, "sglang_router_request_timeout_secs": 14400,
    "sglang_server_concurrency": 512, "prefill_num_servers": None, "sglang_config": None, "sglang_dp_size": 1,
    "sglang_enable_deterministic_inference": False,
}


def derive(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with what slime derives from other arguments where they left it None: the eval context budget is
    the rollout's, the prompt budget leaves one response token, the upper clip is the lower one, the eval reward
    key is the rollout's, over-sampling asks the batch size, the logprob pass packs as the training pass."""
    out = dict(values)
    fallbacks = (("eval_max_context_len", "rollout_max_context_len"), ("eps_clip_high", "eps_clip"),
                 ("eval_reward_key", "reward_key"), ("eval_function_path", "rollout_function_path"),
                 ("over_sampling_batch_size", "rollout_batch_size"),
                 ("log_probs_max_tokens_per_gpu", "max_tokens_per_gpu"))
    for name, source in fallbacks:
        if out.get(name) is None:
            out[name] = out.get(source)
    if out.get("rollout_max_prompt_len") is None and out.get("rollout_max_context_len") is not None:
        out["rollout_max_prompt_len"] = out["rollout_max_context_len"] - 1
    out["use_critic"] = out.get("advantage_estimator") == "ppo"
    return out
