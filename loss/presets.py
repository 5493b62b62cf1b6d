"""Named algorithms as `LossConfig` settings (`loss.preset`), and the check that a config's settings fit together.

A preset only supplies defaults: `LossConfig(preset=...)` fills every field the caller did not pass from `PRESETS`.
`incoherences` lists the combinations that run but are not the algorithm their names suggest; `LossConfig` warns.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loss.config import LossConfig

# Each entry is the paper's combination in LossConfig's own field names; docs/algorithms.md ("Presets") lists the
# same values with their sources, and a test checks that the two agree.
_GROUP_NORMALISED = {"advantage_estimator": "grpo", "normalize_std": True}
_PPO_CLIP_02 = {"policy_loss": "ppo_clip", "clip_low": 0.2, "clip_high": 0.2}
_NO_KL_NO_CORRECTION = {"kl_loss_coef": 0.0, "correction": "none", "old_logprobs_from": "given"}
_TRAIN_INFER_MASK = {"correction": "icepop", "correction_low": 0.5, "correction_high": 2.0}

PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {**_GROUP_NORMALISED, **_PPO_CLIP_02, "aggregation": "seq_mean_token_mean",
             "kl_loss_coef": 0.04, "kl_estimator": "k3", "correction": "none", "old_logprobs_from": "given"},
    "dapo": {**_GROUP_NORMALISED, "policy_loss": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28,
             "aggregation": "token_mean", **_NO_KL_NO_CORRECTION},
    "dr_grpo": {"advantage_estimator": "dr_grpo", "normalize_std": False, **_PPO_CLIP_02,
                "aggregation": "seq_mean_token_sum_norm", **_NO_KL_NO_CORRECTION},
    "gspo": {**_GROUP_NORMALISED, "policy_loss": "gspo", "gspo_clip_low": 3e-4, "gspo_clip_high": 4e-4,
             "aggregation": "seq_mean_token_mean", **_NO_KL_NO_CORRECTION},
    "cispo": {**_GROUP_NORMALISED, "policy_loss": "cispo", "cispo_clip_low": 1.0, "cispo_clip_high": 4.0,
              "aggregation": "token_mean", **_NO_KL_NO_CORRECTION},
    "mu_grpo": {**_GROUP_NORMALISED, "policy_loss": "mu_grpo", "mu_clip_low": 1.0, "mu_clip_high": 4.0,
                "veto_ratio": 2.0, "aggregation": "token_mean", **_NO_KL_NO_CORRECTION},
    "rloo": {"advantage_estimator": "rloo", "policy_loss": "reinforce", "aggregation": "seq_mean_token_sum",
             **_NO_KL_NO_CORRECTION},
    "reinforce_pp": {"advantage_estimator": "reinforce_pp", "gamma": 1.0, **_PPO_CLIP_02,
                     "aggregation": "token_mean", **_NO_KL_NO_CORRECTION},
    "reinforce_pp_baseline": {"advantage_estimator": "reinforce_pp_baseline", "gamma": 1.0, **_PPO_CLIP_02,
                              "aggregation": "token_mean", **_NO_KL_NO_CORRECTION},
    "decoupled": {**_GROUP_NORMALISED, **_PPO_CLIP_02, "aggregation": "token_mean", "kl_loss_coef": 0.0,
                  **_TRAIN_INFER_MASK, "old_logprobs_from": "given", "clip_against": "proximal"},
    # The pairing the learning table of issue 10 ran as `trainer.old_logprobs: snapshot` + IcePop: the clip's ratio
    # is against each token's own (stale) version, i.e. coupled PPO against the behaviour policy, which clips most of
    # the gradient away once staleness exceeds what the clip band allows (docs/async.md). Kept by name only.
    "coupled_snapshot": {**_GROUP_NORMALISED, **_PPO_CLIP_02, "aggregation": "token_mean", "kl_loss_coef": 0.0,
                         **_TRAIN_INFER_MASK, "old_logprobs_from": "given", "clip_against": "behaviour"},
    "ppo_ewma": {**_GROUP_NORMALISED, **_PPO_CLIP_02, "aggregation": "token_mean", "kl_loss_coef": 0.0,
                 **_TRAIN_INFER_MASK, "old_logprobs_from": "ewma", "ewma_beta": 0.5},
}

# Fields only one method reads, by the field that picks the method: set elsewhere they have no effect.
_READ_ONLY_BY: dict[str, tuple[str, str]] = {
    **{f: ("policy_loss", "ppo_clip") for f in ("clip_low", "clip_high", "dual_clip")},
    **{f: ("policy_loss", "gspo") for f in ("gspo_clip_low", "gspo_clip_high")},
    **{f: ("policy_loss", "cispo") for f in ("cispo_clip_low", "cispo_clip_high")},
    **{f: ("policy_loss", "mu_grpo") for f in ("mu_clip_low", "mu_clip_high", "veto_ratio")},
    "ewma_beta": ("old_logprobs_from", "ewma"),
    "norm_length": ("aggregation", "seq_mean_token_sum_norm"),
}


class IncoherentLossWarning(UserWarning):
    """A loss config that runs but is not the algorithm its settings name; the message names the fix."""


def warn_if_incoherent(cfg: "LossConfig") -> None:
    """One warning per incoherence; Python's warning registry shows each distinct message once per process."""
    for message in incoherences(cfg):
        warnings.warn(message, IncoherentLossWarning, stacklevel=1)


def incoherences(cfg: "LossConfig") -> list[str]:
    """Messages for the combinations in cfg that mix two algorithms or set a knob nothing reads; [] if none."""
    found = []
    if cfg.policy_loss == "gspo" and cfg.aggregation != "seq_mean_token_mean":
        found.append(f"loss.policy_loss: gspo with loss.aggregation: {cfg.aggregation} weights each sequence by its "
                     "number of tokens, GSPO weights sequences equally; set loss.aggregation: seq_mean_token_mean")
    if cfg.advantage_estimator == "dr_grpo" and cfg.aggregation != "seq_mean_token_sum_norm":
        found.append(f"loss.advantage_estimator: dr_grpo with loss.aggregation: {cfg.aggregation} is not Dr.GRPO, "
                     "which divides every sequence's token sum by one constant length; set loss.aggregation: "
                     "seq_mean_token_sum_norm and loss.norm_length to rollout.sampling.max_new_tokens")
    if cfg.aggregation == "seq_mean_token_sum_norm" and cfg.advantage_estimator == "grpo" and cfg.normalize_std:
        found.append("loss.aggregation: seq_mean_token_sum_norm (Dr.GRPO's normaliser) with loss.advantage_estimator: "
                     "grpo keeps the group-std division Dr.GRPO removes; set loss.advantage_estimator: dr_grpo "
                     "(or loss.normalize_std: false)")
    if cfg.old_logprobs_from == "ewma" and cfg.correction == "none":
        found.append("loss.old_logprobs_from: ewma with loss.correction: none drops the proximal/behaviour weight "
                     "pi_prox/pi_rollout (the clip covers only pi_theta/pi_prox); set loss.correction: icepop "
                     "(or tis / mis)")
    if cfg.old_logprobs_from == "rollout" and cfg.correction != "none":
        found.append(f"loss.correction: {cfg.correction} has no effect with loss.old_logprobs_from: rollout "
                     "(pi_old is the rollout policy, so the discrepancy ratio is 1); set loss.correction: none, "
                     "or loss.old_logprobs_from: given to correct the train/inference discrepancy")
    if cfg.clip_against == "behaviour" and cfg.old_logprobs_from != "given":
        found.append(f"loss.clip_against: behaviour has no effect with loss.old_logprobs_from: {cfg.old_logprobs_from} "
                     "(it picks the snapshot old logprobs over the proximal ones, which only given old logprobs "
                     "have); drop loss.clip_against")
    if cfg.kl_loss_coef > 0 and cfg.kl_estimator == "k1":
        found.append("loss.kl_estimator: k1 as a loss term (loss.kl_loss_coef > 0) has zero expected gradient on "
                     "policy samples, so it does not pull towards the reference; set loss.kl_estimator: k3 (or k2)")
    return found + _unread_fields(cfg)


def _unread_fields(cfg: "LossConfig") -> list[str]:
    """A method-specific field set (off its default, and not by the preset) while another method is picked."""
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    defaults.update(PRESETS.get(cfg.preset, {}))
    found = []
    for name, (selector, method) in _READ_ONLY_BY.items():
        chosen = getattr(cfg, selector)
        if chosen != method and getattr(cfg, name) != defaults[name]:
            found.append(f"loss.{name} is read only by loss.{selector}: {method}, and this config uses {chosen}, so "
                         f"it has no effect; set loss.{selector}: {method}, or drop loss.{name}")
    return found
