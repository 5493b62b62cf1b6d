"""Rollout functions: user code that turns one prompt into one group of scored samples. glue loads them by
import path from the config (`rollout.function`, `rollout.task`) and never imports this package itself.

The contract (checked at start-up by `glue.plugins.check_signature`)::

    async def my_rollout(ctx: glue.rollout.manager.RolloutContext, prompt: dict, num_samples: int) -> list[glue.types.Sample]

- `ctx.client.generate(input_ids, sampling_params, return_logprob=True)` posts SGLang's /generate through the
  router and returns its JSON (`output_ids`, `meta_info.output_token_logprobs`, `meta_info.finish_reason`,
  `meta_info.weight_version`). `ctx.sampling_params` is the run's SGLang sampling_params (a private copy),
  `ctx.reward_fn(sample)` is the task's reward (float or a dict with a "score" key; may be async; a plain one is
  run on a thread by `score`, so it must be thread-safe), and `ctx.group_id` is the group being generated.
- Return exactly `num_samples` Samples. Fill each with `glue.rollout.manager.append_generation(sample, output)` (response
  tokens, rollout logprobs, per-token weight versions, status from finish_reason) or `Sample.append_response`
  for tool / environment tokens (`trainable=False`), then set the reward (`await glue.rollout.manager.score(ctx, sample)`).
  Rewards are computed here, in the rollout path, never in the trainer. A sample that could not be scored gets
  `status=SampleStatus.FAILED` rather than being dropped; the manager rejects a non-finite reward.
- MoE routing replay (R3, `rollout.return_routed_experts`): `ctx.routed_experts` is the model's routing layout
  (else None). Pass `**ctx.routing_request(sample)` to `generate` (it asks for the routing of the positions the
  sample has none for; such requests go to an engine directly, as sgl-router drops the field) and
  `ctx.routed_experts` to `append_generation`; the sample's `routed_experts` array then grows with its tokens.

A task is a class (built with `rollout.task_args`) or an object with `prompts(seed) -> Iterator[dict]` (each dict
has `prompt_tokens: list[int]` plus whatever the reward needs; single_turn copies the extra keys into
`sample.metadata`) and `reward(sample) -> float`.

- Rewards served by models (`judge:`, `reward_model:`; docs/reward_models.md) are added to each group after the
  function returns; `ctx.judge` (or None) lets a function ask the run's LLM judge itself.

Built-ins: `rollout_fns.single_turn:generate_group` (n concurrent generate calls per prompt),
`rollout_fns.multi_turn:generate_group` (episodes against an environment, `rollout_fns.envs`, turn spans in
`sample.metadata["turns"]`), `rollout_fns.openai_agent:generate_group` (agents written with the `openai` client),
`rollout_fns.slime_functions:generate_group` (slime's generate / rollout / reward functions, unchanged: set by
`rollout.slime.*`) and `rollout_fns.toy_tasks:EchoTask` (the demo's task). See docs/rollout_functions.md.
"""
