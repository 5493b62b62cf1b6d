"""The `teacher:` section and the demo's echo teacher: config checks naming the field, the build hook's contract,
and a teacher that solves the echo task by construction."""
import pytest
import torch

from glue.rewards.config import TeacherConfig
from glue.rewards.teacher import build_teacher_model
from launch.config import ConfigError, load_config


@pytest.mark.parametrize("fields, named", [
    ({}, "teacher.path"), ({"path": "/m", "build": "a.b:c"}, "teacher.path"),
    ({"path": "/m", "num_engines": 0}, "teacher.num_engines"), ({"path": "/m", "kl_coef": 0.0}, "teacher.kl_coef"),
])
def test_a_bad_teacher_section_is_refused_naming_the_field(fields, named):
    with pytest.raises(ValueError, match=named):
        TeacherConfig(**fields)


def test_the_teacher_section_loads_from_yaml_turns_off_with_null_and_takes_gpus_of_its_own():
    cfg = load_config("examples/configs/distill.yaml")
    assert cfg.teacher.build == "rollout_fns.echo_teacher:build_echo_teacher" and cfg.teacher.center
    assert load_config("examples/configs/distill.yaml", ["teacher=null"]).teacher is None
    assert load_config("examples/configs/demo.yaml").teacher is None
    on_gpus = load_config("examples/configs/distill.yaml", ["cluster.gpus_per_node=8", "teacher.gpus=2",
                                                            "teacher.num_engines=2"])
    assert (on_gpus.teacher.gpus, on_gpus.teacher.tensor_parallel_size) == (2, None)
    with pytest.raises(ConfigError, match="teacher.gpus must be >= 1 or null, got 0"):
        load_config("examples/configs/distill.yaml", ["teacher.gpus=0"])
    with pytest.raises(ConfigError, match="teacher.objective"):
        load_config("examples/configs/distill.yaml", ["teacher.objective=forward_kl"])


def test_a_build_hook_with_another_signature_is_refused_before_it_runs(tmp_path):
    with pytest.raises(TypeError, match="out_dir, policy_dir"):
        build_teacher_model("rollout_fns.toy_tasks:EchoTask", str(tmp_path / "t"), str(tmp_path))


def test_the_echo_teacher_solves_the_echo_task_greedily_and_is_sure_of_it(tmp_path):
    from transformers import AutoModelForCausalLM

    from glue.embedded_engine.tiny_model import save_tiny_model
    from glue.types import Sample
    from rollout_fns.echo_teacher import COPY_CONFIDENCE
    from rollout_fns.toy_tasks import EchoTask

    policy = save_tiny_model(tmp_path / "policy")
    build_teacher_model("rollout_fns.echo_teacher:build_echo_teacher", str(tmp_path / "teacher"), policy)
    teacher = AutoModelForCausalLM.from_pretrained(tmp_path / "teacher").eval()
    task, prompts = EchoTask(), EchoTask().prompts(seed=3)
    for _ in range(8):
        prompt = next(prompts)["prompt_tokens"]
        tokens = list(prompt)
        with torch.no_grad():
            for _ in range(task.k):
                probs = torch.softmax(teacher(torch.tensor([tokens])).logits[0, -1], -1)
                tokens.append(int(probs.argmax()))
                assert float(probs.max()) == pytest.approx(COPY_CONFIDENCE, abs=1e-3)
        assert task.reward(Sample(prompt_tokens=prompt, response_tokens=tokens[len(prompt):])) == 1.0


def test_preflight_refuses_a_teacher_without_the_policys_vocabulary_or_a_build_that_does_not_import(tmp_path):
    from glue.embedded_engine.tiny_model import save_tiny_model
    from launch.run.teacher import check_teacher

    save_tiny_model(tmp_path / "teacher64", vocab_size=64)
    cfg = load_config("examples/configs/distill.yaml", ["teacher.build=null", f"teacher.path={tmp_path}/teacher64"])
    with pytest.raises(ConfigError, match="vocab_size 64, the policy 32"):
        check_teacher(cfg)
    same = load_config("examples/configs/distill.yaml", ["teacher.build=null", f"teacher.path={tmp_path}/teacher64",
                                                         "model.tiny.vocab_size=64"])
    assert "vocab_size 64" in check_teacher(same)
    with pytest.raises(ConfigError, match="did you mean 'EchoTask'"):
        check_teacher(load_config("examples/configs/distill.yaml", ["teacher.build=rollout_fns.toy_tasks:EchoTas"]))
