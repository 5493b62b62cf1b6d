"""The learning table's arithmetic (glue/metrics/learning_curves.py) on hand-made runs, and its plots drawn from the JSON."""
from __future__ import annotations

import json

import pytest

from glue.metrics.learning_curves import add_time_to_target, main, merge_tables, run_curves, summarise_row, time_to_reach, trailing_mean
from glue.metrics.plots import write_eval_runs_plot, write_learning_table_plots


def records(rewards, seconds_per_step):
    return [{"step": 0, "eval/reward_mean": 0.0}] + [
        {"step": i + 1, "rollout/reward_mean": r, "time/elapsed_s": seconds_per_step * (i + 1)}
        for i, r in enumerate(rewards)]


def run(rewards, seconds_per_step, wall_s=100.0):
    return {**run_curves(records(rewards, seconds_per_step)), "wall_s": wall_s}


def test_a_run_s_final_reward_is_the_mean_of_its_last_five_steps_and_step_zero_is_left_out():
    curves = run_curves(records([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 2.0))
    assert curves["final_reward"] == pytest.approx((0.2 + 0.3 + 0.4 + 0.5 + 0.6) / 5)
    assert curves["time_curve"] == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]


def test_time_to_reach_uses_the_trailing_mean_and_is_none_when_never_reached():
    rewards, times = [0.0, 1.0, 1.0, 1.0, 1.0, 1.0], [1, 2, 3, 4, 5, 6]
    assert trailing_mean(rewards)[:3] == [0.0, 0.5, pytest.approx(2 / 3)]
    assert time_to_reach(rewards, times, 0.75) == 4  # (0 + 1 + 1 + 1) / 4 is the first trailing mean >= 0.75
    assert time_to_reach(rewards, times, 1.01) is None


def test_a_run_reaches_its_own_final_reward_though_its_curve_is_stored_rounded():
    curves = run_curves(records([0.123444] * 6, 1.0))  # stored as 0.1234, under the unrounded final 0.123444
    assert curves["reward_curve"][-1] == 0.1234
    assert time_to_reach(curves["reward_curve"], curves["time_curve"], curves["final_reward"]) == 1.0
    assert time_to_reach(curves["reward_curve"], curves["time_curve"], 0.1236) is None


def test_a_row_gives_mean_and_std_by_step_and_by_wall_clock_over_its_seeds():
    slow, fast = run([0.0, 0.2, 0.4, 0.6], 2.0), run([0.2, 0.4, 0.6, 0.8], 1.0, wall_s=50.0)
    row = summarise_row([slow, fast])
    assert row["final_reward_mean"] == pytest.approx((0.3 + 0.5) / 2)
    assert row["reward_by_step"]["mean"] == pytest.approx([0.1, 0.3, 0.5, 0.7])
    assert row["reward_by_step"]["std"] == pytest.approx([0.1414] * 4, abs=1e-4)
    assert row["reward_by_step"]["time_s_mean"] == [1.5, 3.0, 4.5, 6.0]
    by_time = row["reward_by_time"]  # up to the shorter run's end, 4 s: there slow has done 2 steps, fast 4
    assert by_time["time_s"][-1] == 4.0
    assert by_time["mean"][-1] == pytest.approx((0.2 + 0.8) / 2)
    assert row["wall_s_mean"] == 75.0 and row["train_s_mean"] == 6.0


def test_time_to_target_comes_from_the_mean_curve_and_each_run_keeps_its_own():
    row = {**summarise_row([run([0.0, 0.2, 0.4, 0.6], 2.0), run([0.2, 0.4, 0.6, 0.8], 1.0)]), "runs": []}
    row["runs"] = [run([0.0, 0.2, 0.4, 0.6], 2.0), run([0.2, 0.4, 0.6, 0.8], 1.0)]
    add_time_to_target(row, 0.4)
    # mean curve 0.1, 0.3, 0.5, 0.7: trailing means 0.1, 0.2, 0.3, 0.4 -> step 4, at mean time (8 + 4) / 2
    assert row["time_to_target_s"] == 6.0
    assert [r["time_to_target_s"] for r in row["runs"]] == [None, 3.0]
    assert row["runs_reaching_target"] == 1


def row_of(*runs, setup=None):
    return {**summarise_row(list(runs)), "setup": setup or {"max_staleness": 2}, "runs": list(runs)}


def seeded(seed, rewards, seconds_per_step):
    return {**run(rewards, seconds_per_step), "seed": seed}


def table(lr_sections):
    return {"steps": 4, "sections": {name: {"task": name.split("/")[0], "settings": rows}
                                     for name, rows in lr_sections.items()}}


def test_tables_run_in_pieces_merge_with_later_rows_winning_and_targets_recomputed():
    sync_old, sync_new = row_of(seeded(0, [0.0, 0.2, 0.4, 0.6], 2.0)), row_of(seeded(0, [0.1, 0.1, 0.1, 0.1], 2.0))
    fast = row_of(run([0.2, 0.4, 0.6, 0.8], 1.0))
    first = table({"echo/lr=0.005": {"async_s2_default": fast, "sync": sync_old},
                   "calc/lr=0.005": {"sync": sync_old}})
    second = table({"echo/lr=0.005": {"sync": sync_new, "mu_grpo_4_stages": fast}})
    merged = merge_tables([first, second], "echo/lr=0.005", ["sync", "async_s2_default", "mu_grpo_4_stages"])
    echo = merged["sections"]["echo/lr=0.005"]
    assert list(echo["settings"]) == ["sync", "async_s2_default", "mu_grpo_4_stages"]
    assert echo["settings"]["sync"]["runs"] == sync_new["runs"] and echo["target_reward"] == pytest.approx(0.1)
    # against the new sync row's 0.1, the fast row's trailing mean (0.2) reaches it at its first step, 1 s, of 8 s
    assert echo["settings"]["async_s2_default"]["time_to_target_s"] == 1.0
    assert echo["settings"]["async_s2_default"]["time_to_target_vs_sync_train_s"] == pytest.approx(1 / 8)
    assert merged["sections"]["calc/lr=0.005"]["target_reward"] == pytest.approx(0.3)  # untouched section kept
    assert merged["primary"] == "echo/lr=0.005" and merged["settings"] is echo["settings"]


def test_a_row_run_with_more_seeds_gets_them_all_and_is_summarised_again():
    five = table({"echo/lr=0.005": {"sync": row_of(seeded(0, [0.2] * 4, 1.0), seeded(1, [0.4] * 4, 1.0))}})
    more = table({"echo/lr=0.005": {"sync": row_of(seeded(1, [0.6] * 4, 1.0), seeded(2, [1.0] * 4, 3.0))}})
    row = merge_tables([five, more], "echo/lr=0.005")["sections"]["echo/lr=0.005"]["settings"]["sync"]
    assert row["seeds"] == [0, 1, 2] and [r["final_reward"] for r in row["runs"]] == [0.2, 0.6, 1.0]  # seed 1 rerun
    assert row["final_reward_mean"] == pytest.approx(0.6) and row["train_s_mean"] == pytest.approx((4 + 4 + 12) / 3)
    other = table({"echo/lr=0.005": {"sync": row_of(seeded(3, [0.2] * 4, 1.0), setup={"max_staleness": 0})}})
    with pytest.raises(ValueError, match="two setups"):
        merge_tables([five, other], "echo/lr=0.005")


def test_a_section_without_a_sync_row_has_no_target_and_the_primary_falls_back_to_the_first_section():
    merged = merge_tables([table({"calc/lr=0.0025": {"async_s2_default": row_of(run([0.5] * 4, 1.0))}})],
                          "echo/lr=0.005")
    section = merged["sections"]["calc/lr=0.0025"]
    assert merged["primary"] == "calc/lr=0.0025" and section["target_reward"] is None
    assert section["settings"]["async_s2_default"]["time_to_target_s"] is None


def test_the_merge_command_keeps_out_s_own_sections(tmp_path, capsys):
    out, piece = tmp_path / "table.json", tmp_path / "piece.json"
    out.write_text(json.dumps(table({"echo/lr=0.005": {"sync": row_of(run([0.0, 0.2, 0.4, 0.6], 2.0))}})))
    piece.write_text(json.dumps(table({"calc/lr=0.0025": {"sync": row_of(run([0.1] * 4, 1.0))}})))
    main([str(out), str(piece)])
    merged = json.loads(out.read_text())
    assert sorted(merged["sections"]) == ["calc/lr=0.0025", "echo/lr=0.005"] and merged["primary"] == "echo/lr=0.005"
    assert "calc/lr=0.0025 target 0.1" in capsys.readouterr().out


def test_the_table_s_plots_are_drawn_from_its_json_one_per_section(tmp_path):
    runs = [run([0.0, 0.2, 0.4, 0.6], 2.0), run([0.2, 0.4, 0.6, 0.8], 1.0)]
    row = {**summarise_row(runs), "runs": runs}
    table = {"primary": "echo/lr=0.005", "settings": {"sync": row},
             "sections": {"echo/lr=0.005": {"target_reward": 0.4, "settings": {"sync": row, "async_s2_default": row}},
                          "calc/lr=0.0025": {"target_reward": None, "settings": {"sync": row}}}}
    path = tmp_path / "async_learning.json"
    path.write_text(json.dumps(table))
    written = write_learning_table_plots(path)
    assert sorted(p.name for p in written) == ["async_learning_calc_lr0.0025.png", "async_learning_echo_lr0.005.png"]
    assert all(p.stat().st_size > 10_000 for p in written)


def test_eval_runs_of_two_groups_are_drawn_by_step_and_by_wall_clock(tmp_path):
    def eval_run(accuracies, seconds_per_step):
        return {"eval_pass_at_1": {str(8 * i): a for i, a in enumerate(accuracies)},
                "elapsed_s_at_step": {str(8 * i): seconds_per_step * 8 * i for i in range(len(accuracies))}}

    groups = {"sync": [eval_run([0.3, 0.6, 0.8], 20.0), eval_run([0.3, 0.5, 0.7], 21.0)],
              "async S=2": [eval_run([0.3, 0.7, 0.75], 13.0)]}
    path = write_eval_runs_plot(tmp_path / "eval.png", groups, "toy")
    assert path.stat().st_size > 10_000
    with pytest.raises(KeyError):  # a run without the first run's eval steps is refused, not drawn short
        write_eval_runs_plot(tmp_path / "bad.png", {"sync": [eval_run([0.3, 0.6], 1.0), eval_run([0.3], 1.0)]}, "x")
