"""What a run's config decides, in slime's argument names: the values that go over slime's defaults in the `args`
namespace slime's functions receive (glue.rollout.slime.adapter.slime_args). Only settings with slime's meaning are
given; the rest keep slime's defaults (glue.rollout.slime.defaults). Imports no backend."""
from __future__ import annotations

from typing import Any


def tokens_per_gpu(budget: int | str | None) -> int | None:
    """slime's max_tokens_per_gpu for sluice's packing budget: the number when one is set, else None (slime's
    default: no dynamic batch), "auto" included since its size is known only on the trainer's device."""
    return budget if isinstance(budget, int) and budget > 0 else None


def run_values(cfg: Any) -> dict[str, Any]:
    """slime's names -> this run's values (cfg: launch.config.SluiceConfig)."""
    cluster, rollout, task = cfg.cluster, cfg.rollout, cfg.rollout.task_args
    engine_tp = cluster.engine_tensor_parallel_size
    values = {
        "rollout_num_gpus": cluster.engine_gpus or rollout.num_engines * engine_tp,
        "rollout_num_gpus_per_engine": engine_tp, "colocate": cluster.placement == "colocated",
        "num_rollout": cfg.run.num_steps, "num_steps_per_rollout": cfg.trainer.num_mini_batches,
        "update_weights_interval": cfg.sync.interval, "update_weight_buffer_size": cfg.sync.bucket_bytes,
        "eval_max_context_len": rollout.slime.eval_max_context_len,
        "rollout_function_path": rollout.slime.rollout_function,
        "over_sampling_batch_size": rollout.slime.over_sampling_batch_size,
        "use_dynamic_batch_size": tokens_per_gpu(cfg.trainer.max_tokens_per_micro_batch) is not None,
        "use_kl_loss": bool(cfg.loss.kl_loss_coef), "kl_loss_coef": cfg.loss.kl_loss_coef,
        "entropy_coef": cfg.loss.entropy_coef,
    }
    for name, key in (("prompt_data", "path"), ("input_key", "prompt_key"), ("label_key", "label_key"),
                      ("apply_chat_template", "apply_chat_template"), ("rollout_shuffle", "shuffle"),
                      ("rollout_max_prompt_len", "max_prompt_tokens")):
        if key in task:
            values[name] = task[key]
    return {name: value for name, value in values.items() if value is not None}
