"""glue.plugins: user code loaded by import path, with errors that name the path and the cause."""
from __future__ import annotations

import sys
import time

import pytest

from glue.plugins import check_signature, load_object

EXPECTED = ["ctx", "prompt", "num_samples"]


def test_both_path_spellings_load_the_same_object():
    from rollout_fns.single_turn import generate_group

    assert load_object("rollout_fns.single_turn:generate_group", what="rollout function") is generate_group
    assert load_object("rollout_fns.single_turn.generate_group", what="rollout function") is generate_group


def test_a_missing_module_is_named_with_the_path():
    with pytest.raises(ImportError) as err:
        load_object("rollout_fns.single_trun:generate_group", what="rollout function")
    message = str(err.value)
    assert "rollout function" in message
    assert "'rollout_fns.single_trun:generate_group'" in message
    assert "module 'rollout_fns.single_trun' not found" in message


def test_a_missing_attribute_suggests_the_near_name():
    with pytest.raises(AttributeError) as err:
        load_object("rollout_fns.single_turn:generate_grop", what="rollout function")
    message = str(err.value)
    assert "has no attribute 'generate_grop'" in message
    assert "did you mean 'generate_group'" in message


def test_a_module_whose_own_import_fails_names_the_missing_dependency(tmp_path, monkeypatch):
    (tmp_path / "plugin_with_bad_dep.py").write_text("import not_a_real_package_for_sluice\n\nasync def fn(ctx, prompt, num_samples): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError) as err:
        load_object("plugin_with_bad_dep:fn", what="task")
    assert "install the missing package 'not_a_real_package_for_sluice'" in str(err.value)
    sys.modules.pop("plugin_with_bad_dep", None)


def test_a_path_without_an_attribute_is_rejected_with_the_expected_form():
    with pytest.raises(ValueError, match="write it as 'package.module:name'"):
        load_object("rollout_fns:", what="task")


async def good_rollout(ctx, prompt, num_samples):
    return []


def sync_rollout(ctx, prompt, num_samples):
    return []


async def renamed_rollout(context, prompt, n):
    return []


async def extra_required_keyword(ctx, prompt, num_samples, *, temperature):
    return []


class CallableRollout:
    async def __call__(self, ctx, prompt, num_samples):
        return []


def test_the_documented_signature_passes_and_so_does_an_async_callable_object():
    check_signature(good_rollout, EXPECTED, "rollout function")
    check_signature(CallableRollout(), EXPECTED, "rollout function")


def test_a_sync_function_fails_showing_the_expected_async_signature():
    with pytest.raises(TypeError) as err:
        check_signature(sync_rollout, EXPECTED, "rollout function")
    message = str(err.value)
    assert "is not an async function" in message
    assert "async def sync_rollout(ctx, prompt, num_samples)" in message


def test_wrong_parameter_names_or_a_required_extra_keyword_fail_showing_both_signatures():
    with pytest.raises(TypeError) as err:
        check_signature(renamed_rollout, EXPECTED, "rollout function")
    assert "has signature (context, prompt, n)" in str(err.value)
    assert "expected `async def renamed_rollout(ctx, prompt, num_samples)`" in str(err.value)
    with pytest.raises(TypeError, match=r"\*, temperature"):
        check_signature(extra_required_keyword, EXPECTED, "rollout function")


def test_a_bad_config_path_fails_within_the_first_second():
    start = time.monotonic()
    with pytest.raises(AttributeError):
        fn = load_object("rollout_fns.toy_tasks:EchoTsak", what="task")
        check_signature(fn, EXPECTED, "task")
    assert time.monotonic() - start < 1.0


def test_an_old_glue_module_path_is_refused_with_its_new_one():
    with pytest.raises(ImportError, match=r"'glue.judge' moved to glue.rewards.judge"):
        load_object("glue.judge:Judge", what="judge")
    with pytest.raises(AttributeError, match=r"'glue.fleet' moved to glue.fleet.fleet"):
        load_object("glue.fleet:RolloutFleet", what="fleet")
    assert load_object("glue.rewards.judge:Judge", what="judge").__name__ == "Judge"


def test_a_user_module_importing_an_old_glue_path_is_named_with_the_new_one(tmp_path, monkeypatch):
    (tmp_path / "old_style_rollout.py").write_text("from glue.engine_client import EngineClient\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=r"'glue.engine_client' \(imported by 'old_style_rollout'\) moved to "
                                          r"glue.fleet.engine_client"):
        load_object("old_style_rollout:generate", what="rollout function")


def test_the_rollout_function_api_still_loads_from_the_rollout_wing():
    from glue.rollout import RolloutContext, append_generation
    from glue.rollout.manager import RolloutContext as direct

    assert RolloutContext is direct and callable(append_generation)
