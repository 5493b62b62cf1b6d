"""launch/tools/shrink.py on a distillation recipe: the teacher's checkpoint gives way to a stand-in of the tiny policy's
shape, recorded as dropped and added, and the shrunk recipe still resolves."""
import yaml

from launch.tools.shrink import shrink, stand_in_teacher


def test_a_teacher_checkpoint_is_swapped_for_a_stand_in_and_its_fleet_shrunk(tmp_path):
    raw = yaml.safe_load(open("examples/configs/distill.yaml"))
    raw["teacher"] = {"path": "/models/Qwen3-32B", "num_engines": 8, "kl_coef": 0.5}
    shrunk = shrink(raw, data_dir=tmp_path)
    assert shrunk.raw["teacher"] == {"build": "launch.tools.shrink:stand_in_teacher", "num_engines": 2, "kl_coef": 0.5}
    assert shrunk.record.dropped["teacher.path"]["value"] == "/models/Qwen3-32B"
    assert shrunk.record.added["teacher.build"]["to"] == "launch.tools.shrink:stand_in_teacher"
    assert shrunk.record.kept["teacher.kl_coef"] == 0.5
    from launch.config import load_config

    (tmp_path / "shrunk.yaml").write_text(yaml.safe_dump(shrunk.raw))
    assert load_config(tmp_path / "shrunk.yaml").teacher.build == "launch.tools.shrink:stand_in_teacher"


def test_the_stand_in_teacher_has_the_policys_vocabulary_and_its_own_weights(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from glue.embedded_engine.tiny_model import save_tiny_model
    from glue.rewards.teacher import build_teacher_model

    policy = save_tiny_model(tmp_path / "policy", vocab_size=40)
    build_teacher_model("launch.tools.shrink:stand_in_teacher", str(tmp_path / "teacher"), policy)
    teacher = AutoModelForCausalLM.from_pretrained(tmp_path / "teacher")
    student = AutoModelForCausalLM.from_pretrained(policy)
    assert teacher.config.vocab_size == 40
    assert not torch.equal(teacher.get_input_embeddings().weight, student.get_input_embeddings().weight)
