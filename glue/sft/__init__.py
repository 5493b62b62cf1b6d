"""Supervised fine-tuning (`run.mode: sft`): chat data (`sft:` section, glue.sft.config) tokenized with the model's
chat template into conversations whose assistant tokens alone are trained (glue.sft.data), fed step by step to the
same megatron-core trainer an RL run uses, with loss.sft_loss (glue.sft.loop). launch.run.sft brings the run up.
May import: every other wing (it stands above the loop), loss. Nothing in glue imports it."""
