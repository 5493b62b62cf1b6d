"""`LossConfig`: the `loss:` section of a run config. Every method is picked by name from an explicit registry;
`preset` names a paper's combination (loss/presets.py) whose settings become the defaults of the fields not given.
`__post_init__` checks names (with a "did you mean"), ranges and coherence, naming the field. Imports torch only
when a config is built (the registries)."""
from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass

from loss.presets import PRESETS, warn_if_incoherent


def registries() -> dict[str, dict]:
    """Field -> the registry its name is looked up in. Imported when a LossConfig is built, not with this module:
    the registries hold torch functions, and the config's definition (`sluice --help`) needs none of them."""
    from loss.advantages import ADVANTAGE_ESTIMATORS  # lazy: torch, kept off sluice --help
    from loss.aggregation import AGGREGATIONS  # lazy: torch, kept off sluice --help
    from loss.corrections import CLIP_REFERENCES, CORRECTIONS, OLD_LOGPROB_SOURCES  # lazy: torch, kept off sluice --help
    from loss.kl import KL_ESTIMATORS  # lazy: torch, kept off sluice --help
    from loss.policy import POLICY_LOSSES  # lazy: torch, kept off sluice --help

    return {"advantage_estimator": ADVANTAGE_ESTIMATORS, "policy_loss": POLICY_LOSSES, "correction": CORRECTIONS,
            "old_logprobs_from": OLD_LOGPROB_SOURCES, "kl_estimator": KL_ESTIMATORS, "aggregation": AGGREGATIONS,
            "clip_against": CLIP_REFERENCES}


def _preset_gives_defaults(cls: type) -> type:
    """Wrap the dataclass __init__ so that `preset=NAME` fills every field the caller did not pass from
    PRESETS[NAME]: a field given beside the preset (in Python, or as a key of the YAML `loss:` section) wins."""
    generated_init = cls.__init__

    @functools.wraps(generated_init)
    def __init__(self, **fields) -> None:
        name = fields.get("preset")
        if name is not None:
            check_name("loss.preset", name, PRESETS)
            fields = {**PRESETS[name], **fields}
        generated_init(self, **fields)

    cls.__init__ = __init__
    return cls


@_preset_gives_defaults
@dataclass(kw_only=True)
class LossConfig:
    preset: str | None = None  # name in PRESETS (grpo, dapo, gspo, ...): that paper's settings as defaults
    # --- advantages (compute_advantages) ---
    advantage_estimator: str = "grpo"  # name in ADVANTAGE_ESTIMATORS: grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, gae
    normalize_std: bool = True  # grpo: divide by the group's reward std
    std_floor: float = 1e-6  # grpo / whitening: the std is clamped to at least this
    whiten_advantages: bool = False  # whiten the advantages over all valid tokens of the batch after the estimator
    gamma: float = 1.0  # discount for reinforce_pp* returns and gae
    gae_lambda: float = 1.0  # gae's lambda
    value_clip: float | None = 0.2  # gae's critic: PPO value clipping, each value moves at most this far from the critic's value before the update per train step (null: plain squared error; docs/critic.md)
    kl_reward_coef: float = 0.0  # > 0: subtract coef * KL(pi_old || pi_ref) per token from the reward (needs ref logprobs)
    # --- policy loss (compute_policy_loss) ---
    policy_loss: str = "ppo_clip"  # name in POLICY_LOSSES: ppo_clip, gspo, cispo, mu_grpo, reinforce
    clip_low: float = 0.2  # ppo_clip: ratio lower bound is 1 - clip_low
    clip_high: float = 0.2  # ppo_clip: ratio upper bound is 1 + clip_high (DAPO clip-higher: 0.28)
    dual_clip: float | None = None  # ppo_clip: > 1 caps the loss of negative-advantage tokens at -dual_clip * A (e.g. 3)
    gspo_clip_low: float = 3e-4  # gspo: sequence ratio lower bound 1 - gspo_clip_low
    gspo_clip_high: float = 4e-4  # gspo: sequence ratio upper bound 1 + gspo_clip_high
    cispo_clip_low: float = 1.0  # cispo: IS weight lower bound 1 - cispo_clip_low (1.0: no lower bound)
    cispo_clip_high: float = 4.0  # cispo: IS weight upper bound 1 + cispo_clip_high
    mu_clip_low: float = 1.0  # mu_grpo: relaxed ratio interval [1 - mu_clip_low, 1 + mu_clip_high] (seed: [0, 5])
    mu_clip_high: float = 4.0  # mu_grpo: see mu_clip_low
    veto_ratio: float = 2.0  # mu_grpo: in a negative-advantage response, veto from the first token with ratio > this
    # --- off-policy: discrepancy factor old/rollout and where old logprobs come from ---
    correction: str = "none"  # name in CORRECTIONS: none, tis, mis, icepop, seq_tis, seq_mis, seq_*_arith, seq_*_geo (with recompute old logprobs a correction other than none is decoupled PPO's behaviour weight pi_prox/pi_rollout; none drops it: docs/async.md)
    correction_low: float = 0.5  # lower threshold on the discrepancy ratio (mis masks above high only; tis truncates at high)
    correction_high: float = 2.0  # upper threshold on the discrepancy ratio
    old_logprobs_from: str = "given"  # name in OLD_LOGPROB_SOURCES: given, rollout, ewma
    clip_against: str = "proximal"  # name in CLIP_REFERENCES: proximal (decoupled PPO: the clip's ratio is pi_theta / the weights before the update), behaviour (coupled: pi_theta / the exact old logprobs of trainer.old_logprobs: snapshot, i.e. the stale policy that generated each token; preset coupled_snapshot)
    stale_weight_high: float = 2.0  # proximal_logprobs passed beside snapshot old logprobs: the staleness importance weight pi_prox / pi_snapshot is truncated at this
    ewma_beta: float = 0.5  # ewma: decay of a sample's proximal policy per trainer evaluation of it, in [0, 1)
    # --- KL and entropy terms, and aggregation ---
    kl_estimator: str = "k3"  # name in KL_ESTIMATORS: k1, k2, k3
    kl_loss_coef: float = 0.0  # > 0: add coef * KL(pi_theta || pi_ref) to the loss (needs ref_logprobs)
    entropy_coef: float = 0.0  # > 0: subtract coef * entropy from the loss (needs logits or entropy)
    aggregation: str = "token_mean"  # name in AGGREGATIONS
    norm_length: int | None = None  # seq_mean_token_sum_norm: the constant length (the rollout's max new tokens)
    mask_truncated: bool = False  # DAPO overlong filtering: a sample cut at the length limit (finish reason length) is not trained on; its reward still counts in its group's baseline (loss/truncated_masked_frac)

    def __post_init__(self) -> None:
        for field, registry in registries().items():
            check_name(f"loss.{field}", getattr(self, field), registry)
        if self.preset is not None:
            check_name("loss.preset", self.preset, PRESETS)
        self._check_ranges()
        warn_if_incoherent(self)

    def _check_ranges(self) -> None:
        in_range = [
            ("clip_low", 0 <= self.clip_low <= 1, "in [0, 1]"),
            ("clip_high", self.clip_high >= 0, ">= 0"),
            ("gspo_clip_low", 0 <= self.gspo_clip_low <= 1, "in [0, 1]"),
            ("gspo_clip_high", self.gspo_clip_high >= 0, ">= 0"),
            ("cispo_clip_low", 0 <= self.cispo_clip_low <= 1, "in [0, 1]"),
            ("cispo_clip_high", self.cispo_clip_high >= 0, ">= 0"),
            ("mu_clip_low", 0 <= self.mu_clip_low <= 1, "in [0, 1]"),
            ("mu_clip_high", self.mu_clip_high >= 0, ">= 0"),
            ("veto_ratio", self.veto_ratio > 0, "> 0"),
            ("dual_clip", self.dual_clip is None or self.dual_clip > 1, "> 1 (or null to turn it off)"),
            ("correction_low", 0 < self.correction_low <= 1, "in (0, 1]"),
            ("correction_high", self.correction_high >= 1, ">= 1"),
            ("stale_weight_high", self.stale_weight_high >= 1, ">= 1"),
            ("std_floor", self.std_floor > 0, "> 0"),
            ("gamma", 0 <= self.gamma <= 1, "in [0, 1]"),
            ("gae_lambda", 0 <= self.gae_lambda <= 1, "in [0, 1]"),
            ("ewma_beta", 0 <= self.ewma_beta < 1, "in [0, 1)"),
            ("kl_loss_coef", self.kl_loss_coef >= 0, ">= 0"),
            ("kl_reward_coef", self.kl_reward_coef >= 0, ">= 0"),
            ("entropy_coef", self.entropy_coef >= 0, ">= 0"),
            ("norm_length", self.norm_length is None or self.norm_length >= 1, ">= 1"),
            ("value_clip", self.value_clip is None or self.value_clip > 0, "> 0 (or null for no value clipping)"),
        ]
        for field, ok, want in in_range:
            if not ok:
                raise ValueError(f"loss.{field} must be {want}, got {getattr(self, field)!r}")
        if self.aggregation == "seq_mean_token_sum_norm" and self.norm_length is None:
            raise ValueError("loss.norm_length must be set for aggregation seq_mean_token_sum_norm "
                             "(Dr.GRPO's constant normaliser, also set by preset dr_grpo): set loss.norm_length "
                             "to rollout.sampling.max_new_tokens")

    @property
    def uses_critic(self) -> bool:
        """The advantages come from a value model: the trainer builds a critic and computes them (docs/critic.md)."""
        return self.advantage_estimator == "gae"

    @property
    def needs_old_logprobs(self) -> bool:
        """The trainer must pass training-side old logprobs (recomputed or from version snapshots)."""
        return self.old_logprobs_from == "given"

    @property
    def needs_proximal_logprobs(self) -> bool:
        """With `trainer.old_logprobs: snapshot` the trainer must also pass the current weights' logprobs before the
        update (`proximal_logprobs`): the clip is against those, and the snapshot logprobs are the behaviour policy.
        (With `recompute` the old logprobs are the proximal policy already.)"""
        return self.old_logprobs_from == "given" and self.clip_against == "proximal"


def check_name(field: str, value: str, registry: dict) -> None:
    """Raise ValueError naming the field, the closest known name and all known names when value is not in registry."""
    if value in registry:
        return
    guess = difflib.get_close_matches(str(value), list(registry), n=1)
    hint = f"did you mean {guess[0]!r}? " if guess else ""
    raise ValueError(f"{field} = {value!r} is not a known name; {hint}known: {', '.join(registry)}")
