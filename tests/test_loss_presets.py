"""`loss.preset`: each paper's settings as defaults of `LossConfig`, the docs table that lists them, and the warnings
for combinations that run but are not the algorithm their settings name."""
import dataclasses
import re
import warnings
from pathlib import Path

import pytest
import yaml

from launch.config import ConfigError, load_config, write_resolved
from loss import PRESETS, IncoherentLossWarning, LossConfig
from loss.presets import incoherences

REPO = Path(__file__).resolve().parents[1]
NEEDS = {"dr_grpo": {"norm_length": 1024}}  # the one setting a preset cannot know: the rollout's max new tokens


def build_quietly(**fields) -> LossConfig:
    """LossConfig(**fields), failing the test on any incoherence warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", IncoherentLossWarning)
        return LossConfig(**fields)


def docs_preset_table() -> dict[str, dict]:
    """The first table under '## Presets' in docs/algorithms.md: preset name -> every `key: value` in its settings
    cells (all but the first and the last column), values read as YAML."""
    lines = (REPO / "docs/algorithms.md").read_text().splitlines()
    start = lines.index(next(line for line in lines if line.startswith("## Presets")))
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    table = {}
    for row in rows[2:]:  # header and separator
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        settings = " ".join(cells[1:-1])
        table[cells[0].strip("`")] = {k: yaml.safe_load(v) for k, v in re.findall(r"`(\w+): ([^`]+)`", settings)}
    return table


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds_a_coherent_config_holding_exactly_its_settings(name):
    cfg = build_quietly(preset=name, **NEEDS.get(name, {}))
    assert cfg.preset == name
    assert {key: getattr(cfg, key) for key in PRESETS[name]} == PRESETS[name]
    given = {"preset", *PRESETS[name], *NEEDS.get(name, {})}
    untouched = {f.name for f in dataclasses.fields(LossConfig)} - given
    plain = LossConfig()
    assert all(getattr(cfg, key) == getattr(plain, key) for key in untouched), name
    assert incoherences(cfg) == []


def test_the_docs_table_lists_every_preset_with_exactly_the_settings_of_the_code():
    table = docs_preset_table()
    assert list(table) == list(PRESETS)
    for name, settings in table.items():
        assert settings == PRESETS[name], name


def test_the_paper_values_that_define_each_algorithm():
    dapo, gspo, dr = PRESETS["dapo"], PRESETS["gspo"], PRESETS["dr_grpo"]
    assert (dapo["clip_low"], dapo["clip_high"], dapo["kl_loss_coef"]) == (0.2, 0.28, 0.0)
    assert dapo["aggregation"] == "token_mean"
    assert (gspo["policy_loss"], gspo["gspo_clip_low"], gspo["gspo_clip_high"]) == ("gspo", 3e-4, 4e-4)
    assert gspo["aggregation"] == "seq_mean_token_mean"
    assert (dr["advantage_estimator"], dr["aggregation"]) == ("dr_grpo", "seq_mean_token_sum_norm")
    assert (PRESETS["grpo"]["kl_loss_coef"], PRESETS["grpo"]["kl_estimator"]) == (0.04, "k3")
    mu = LossConfig(preset="mu_grpo")
    assert (1 - mu.mu_clip_low, 1 + mu.mu_clip_high, mu.policy_loss) == (0.0, 5.0, "mu_grpo")  # Mu-GRPO ("How Off-Policy Can GRPO Be?"): [0, 5]
    assert LossConfig(preset="ppo_ewma").correction != "none"


def test_dr_grpo_without_its_constant_normaliser_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="set loss.norm_length to rollout.sampling.max_new_tokens"):
        LossConfig(preset="dr_grpo")


def test_fields_given_beside_a_preset_win_even_when_they_equal_the_plain_default():
    cfg = build_quietly(preset="dapo", clip_high=0.3, kl_loss_coef=0.01)
    assert (cfg.clip_low, cfg.clip_high, cfg.kl_loss_coef) == (0.2, 0.3, 0.01)
    assert build_quietly(preset="dapo", clip_high=0.2).clip_high == 0.2  # 0.2 is also LossConfig's own default
    with pytest.warns(IncoherentLossWarning):
        assert LossConfig(preset="gspo", aggregation="token_mean").aggregation == "token_mean"


def test_a_preset_in_the_yaml_loss_section_is_overridden_by_keys_beside_it_and_by_the_cli(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("loss: {preset: dapo, clip_high: 0.3}\n")
    cfg = load_config(path, ["loss.clip_low=0.1"])
    assert (cfg.loss.preset, cfg.loss.clip_low, cfg.loss.clip_high) == ("dapo", 0.1, 0.3)
    assert cfg.loss.aggregation == "token_mean"  # from the preset
    assert load_config(None, ["loss.preset=gspo"]).loss.policy_loss == "gspo"


def test_an_unknown_preset_is_refused_with_the_closest_name():
    with pytest.raises(ValueError, match=r"loss.preset = 'dapo2' is not a known name; did you mean 'dapo'"):
        LossConfig(preset="dapo2")
    with pytest.raises(ConfigError, match="did you mean 'gspo'"):
        load_config(None, ["loss.preset=gpso"])


def test_a_resolved_config_reloads_to_the_same_loss_config(tmp_path):
    cfg = load_config(None, ["loss.preset=gspo", "loss.gspo_clip_high=0.001"])
    write_resolved(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml").loss == cfg.loss
    assert dataclasses.replace(cfg.loss, entropy_coef=0.01).gspo_clip_high == 0.001  # replace keeps explicit values


@pytest.mark.parametrize("fields,fix", [
    ({"preset": "gspo", "aggregation": "token_mean"}, "set loss.aggregation: seq_mean_token_mean"),
    ({"policy_loss": "gspo"}, "weights each sequence by its number of tokens"),
    ({"preset": "dr_grpo", "norm_length": 64, "aggregation": "seq_mean_token_mean"},
     "is not Dr.GRPO, which divides every sequence's token sum by one constant length; set loss.aggregation: "
     "seq_mean_token_sum_norm and loss.norm_length"),
    ({"aggregation": "seq_mean_token_sum_norm", "norm_length": 64}, "set loss.advantage_estimator: dr_grpo"),
    ({"preset": "ppo_ewma", "correction": "none"}, "drops the proximal/behaviour weight"),
    ({"old_logprobs_from": "ewma"}, "set loss.correction: icepop"),
    ({"old_logprobs_from": "rollout", "correction": "tis"}, "has no effect"),
    ({"kl_loss_coef": 0.1, "kl_estimator": "k1"}, "set loss.kl_estimator: k3"),
    ({"preset": "gspo", "clip_high": 0.28}, "loss.clip_high is read only by loss.policy_loss: ppo_clip"),
    ({"ewma_beta": 0.9}, "set loss.old_logprobs_from: ewma, or drop loss.ewma_beta"),
])
def test_an_incoherent_combination_warns_naming_the_fix(fields, fix):
    with pytest.warns(IncoherentLossWarning, match=re.escape(fix)):
        LossConfig(**fields)


def test_each_incoherence_warns_once_however_often_the_config_is_built():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            LossConfig(preset="gspo", aggregation="token_mean")
    assert len([w for w in caught if issubclass(w.category, IncoherentLossWarning)]) == 1


def test_a_preset_value_another_method_ignores_is_not_reported_as_the_users():
    cfg = LossConfig(preset="dapo", policy_loss="cispo")  # dapo's clip_high 0.28 came from the preset
    assert not any("clip_high" in message for message in incoherences(cfg))


def test_the_default_config_and_every_example_config_load_without_a_warning():
    build_quietly()
    for path in sorted((REPO / "examples/configs").glob("*.yaml")):
        with warnings.catch_warnings():
            warnings.simplefilter("error", IncoherentLossWarning)
            load_config(path)


def test_the_mu_grpo_example_keeps_the_settings_it_spelled_out_before_using_the_preset():
    loss_cfg = load_config(REPO / "examples/configs/mu_grpo.yaml").loss
    before = LossConfig(advantage_estimator="grpo", policy_loss="mu_grpo", mu_clip_low=1.0, mu_clip_high=4.0,
                        veto_ratio=2.0)
    assert dataclasses.replace(loss_cfg, preset=None) == before
