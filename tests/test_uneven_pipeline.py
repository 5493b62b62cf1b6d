"""Uneven pipeline stages (megatron-core's num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage,
Megatron-LM's --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers): sluice's stage ranges are
megatron-core's own for every stage, impossible splits are refused in one line, and both flag spellings land in one
config key."""
from __future__ import annotations

import pytest
import torch

from glue.trainer.config import TrainerConfig
from glue.trainer.pipeline import PipelineSplit, planned_stage_layers
from launch.args.command_line import parse_args
from launch.cli import main
from launch.config import load_config
from weight_sync.convert import ParallelLayout, stage_layer_ranges

DEMO = "examples/configs/demo.yaml"
FIRST, LAST = "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"


def megatron_ranges(num_layers: int, pp: int, **fields) -> tuple[range, ...]:
    """Each stage's layers as megatron-core 0.16 computes them on a TransformerConfig: its offset and its count."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                               pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, **fields)
    return tuple(range(get_transformer_layer_offset(config, pp_rank=s),
                       get_transformer_layer_offset(config, pp_rank=s) + get_num_layers_to_build(config, pp_rank=s))
                 for s in range(pp))


def test_61_layers_over_8_stages_with_4_first_and_3_last_give_megatron_cores_stages():
    # 61 - 4 - 3 = 54 layers for the 6 middle stages: 9 each, from layer 4 on; the last stage holds 58-60
    expected = (range(0, 4), range(4, 13), range(13, 22), range(22, 31), range(31, 40), range(40, 49), range(49, 58),
                range(58, 61))
    assert stage_layer_ranges(61, 8, first=4, last=3) == expected
    assert megatron_ranges(61, 8, **{FIRST: 4, LAST: 3}) == expected


@pytest.mark.parametrize("num_layers, pp, first, last, expected", [
    (61, 8, None, 5, [8] * 7 + [5]),  # 56 over the 7 stages before the last
    (61, 2, 30, None, [30, 31]),
    (4, 2, 1, None, [1, 3]),
    (4, 2, None, 1, [3, 1]),
    (4, 2, 1, 3, [1, 3]),
    (3, 3, 1, 1, [1, 1, 1]),
    (8, 4, None, None, [2, 2, 2, 2]),  # even: unchanged
    (61, 1, None, None, [61]),
])
def test_every_stage_range_equals_megatron_cores_offset_and_layer_count(num_layers, pp, first, last, expected):
    fields = {k: v for k, v in ((FIRST, first), (LAST, last)) if v is not None}
    ranges = stage_layer_ranges(num_layers, pp, first=first, last=last)
    assert [len(r) for r in ranges] == expected
    assert ranges[0].start == 0 and ranges[-1].stop == num_layers
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))  # consecutive, nothing left out
    assert ranges == megatron_ranges(num_layers, pp, **fields)


@pytest.mark.parametrize("num_layers, pp, fields, expected", [
    # the embedding counted as a layer: 61 + 1 = 62 over 2 stages, 31 each, the first one short of it
    (61, 2, {"account_for_embedding_in_pipeline_split": True}, [30, 31]),
    # the loss counted as a layer: 7 + 1 = 8 over 4, 2 each, the last one short of it
    (7, 4, {"account_for_loss_in_pipeline_split": True}, [2, 2, 2, 1]),
    (6, 4, {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True},
     [1, 2, 2, 1]),
])
def test_megatron_cores_embedding_and_loss_accounting_are_read_as_the_same_split(num_layers, pp, fields, expected):
    ranges = PipelineSplit.of(fields).ranges(num_layers, pp)
    assert [len(r) for r in ranges] == expected
    assert ranges == megatron_ranges(num_layers, pp, **fields)


@pytest.mark.parametrize("num_layers, pp, first, last, message", [
    (61, 8, 4, None, "num_layers_in_first_pipeline_stage=4 leaves 57 of num_layers=61 for 7 middle pipeline stages, "
                     "which megatron-core splits evenly and 57 does not divide by 7; choose values that leave a "
                     "multiple of 7"),
    (61, 8, None, None, "num_layers=61 does not split evenly over pipeline_model_parallel_size=8; choose a PP size "
                        "that divides it, or set num_layers_in_first_pipeline_stage / "
                        "num_layers_in_last_pipeline_stage (--decoder-first-pipeline-num-layers / "
                        "--decoder-last-pipeline-num-layers)"),
    (4, 2, 2, 1, "num_layers_in_first_pipeline_stage=2 and num_layers_in_last_pipeline_stage=1 must add up to "
                 "num_layers=4 at pipeline_model_parallel_size=2 (no middle stages); choose values that do, or "
                 "leave one unset"),
    (4, 3, 2, 2, "num_layers_in_first_pipeline_stage=2 and num_layers_in_last_pipeline_stage=2 leave 0 of "
                 "num_layers=4 for 1 middle pipeline stage, and megatron-core builds at least one layer on each; "
                 "choose smaller values or a smaller PP size"),
    (4, 2, 0, None, "num_layers_in_first_pipeline_stage=0 must be at least 1 (megatron-core refuses an empty first "
                    "or last stage); give a positive number of layers or leave it unset"),
])
def test_an_impossible_split_is_refused_in_one_line_as_megatron_core_refuses_it(num_layers, pp, first, last,
                                                                                message):
    with pytest.raises(ValueError) as err:
        stage_layer_ranges(num_layers, pp, first=first, last=last)
    assert str(err.value) == message
    fields = {k: v for k, v in ((FIRST, first), (LAST, last)) if v is not None}
    with pytest.raises((ValueError, AssertionError)):  # megatron: its config's check, or its layer count's assert
        megatron_ranges(num_layers, pp, **fields)


def test_more_layers_on_the_first_stage_than_the_model_has_is_refused_though_megatron_core_lets_it_through():
    # megatron-core's check takes 4 - 5 = -1 layers for the one remaining stage (and -1 % 1 == 0); it builds -1
    with pytest.raises(ValueError, match="leaves -1 of num_layers=4 for 1 middle pipeline stage, and megatron-core "
                                         "builds at least one layer on each"):
        stage_layer_ranges(4, 2, first=5)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=1 holds all num_layers=4 in its one stage"):
        stage_layer_ranges(4, 1, first=2)
    assert stage_layer_ranges(4, 1, first=4) == (range(0, 4),)  # at PP=1 megatron-core accepts all of them


def test_a_parallel_layout_of_an_uneven_stage_holds_its_own_layers():
    layouts = [ParallelLayout.pipeline(61, pp_rank=s, pp_size=8, first=4, last=3) for s in range(8)]
    assert [(x.first_layer, x.num_layers) for x in layouts[:2]] == [(0, 4), (4, 9)]
    assert layouts[7].holds_layer(58) and layouts[7].holds_layer(60) and not layouts[6].holds_layer(58)
    assert ParallelLayout.even(8, pp_rank=1, pp_size=4) == ParallelLayout.pipeline(8, pp_rank=1, pp_size=4)


def test_the_weight_group_plan_reads_the_split_from_the_trainers_megatron_values():
    hf = type("HF", (), {"num_hidden_layers": 61})()
    trainer = TrainerConfig(pipeline_model_parallel_size=8, megatron={FIRST: 4, LAST: 3})
    assert planned_stage_layers(hf, trainer) == [(0, 4)] + [(4 + 9 * i, 9) for i in range(6)] + [(58, 3)]


def test_both_flag_spellings_set_one_key_and_two_different_values_are_refused_in_one_line(capsys, tmp_path):
    for flag in ("--decoder-first-pipeline-num-layers", "--num-layers-in-first-pipeline-stage"):
        args, overrides = parse_args(["--config", DEMO, flag, "1", "--pipeline-model-parallel-size", "2"])
        cfg = load_config(args.config, overrides, args.flags, args.slime)
        assert cfg.trainer.megatron[FIRST] == 1, flag
    args, overrides = parse_args(["--config", DEMO, "--decoder-last-pipeline-num-layers", "1",
                                  "--num-layers-in-last-pipeline-stage", "1"])
    assert load_config(args.config, overrides, args.flags, args.slime).trainer.megatron[LAST] == 1
    assert main(["--dry-run", "--config", DEMO, "--decoder-first-pipeline-num-layers", "1",
                 "--num-layers-in-first-pipeline-stage", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (
        "sluice: config error: --decoder-first-pipeline-num-layers 1 and --num-layers-in-first-pipeline-stage 2 set "
        "one config key, trainer.megatron.num_layers_in_first_pipeline_stage, to different values; give one of them")


def test_a_dry_run_refuses_a_split_the_tiny_model_cannot_take_in_one_line(capsys):
    # the tiny model has 2 layers: 2 on the first of 2 stages leaves none for the last
    assert main(["--dry-run", "--config", DEMO, "--pipeline-model-parallel-size", "2", "trainer.data_parallel_size=1",
                 "--decoder-first-pipeline-num-layers", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (
        "sluice: config error: num_layers_in_first_pipeline_stage=2 leaves 0 of num_layers=2 for 1 middle pipeline "
        "stage, and megatron-core builds at least one layer on each; choose smaller values or a smaller PP size")
