"""The name tables against REAL megatron-core GPTModels on CPU/gloo (2 spawned ranks): the megatron names and shapes
the converter produces are exactly those of a model built at TP=1/TP=2 (every family), PP=2 and EP=2 (the MoE
families), scaled RoPE and multi-latent attention included;
loading them and reading the model's own state back round-trips to the HF checkpoint bit-exactly; and the loaded
models compute the HF model's logprobs, which proves the table right, not just self-consistent."""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import pickle
import queue
import socket

import pytest
import torch

from glue.embedded_engine.tiny_model import save_tiny_model
from weight_sync.convert import ParallelLayout, hf_to_megatron_local, megatron_to_hf, padded_vocab_size
from weight_sync.families import family_of
from helpers.forkserver import rank_context

# (family, extra config fields); every case below names one of these models.
MODELS = {
    "llama": ("llama", dict(vocab_size=30)),  # padded to 32 in megatron
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", dict(num_layers=4)),
    # HF's other routing (no top-k renormalisation) and a dense layer among MoE layers
    "qwen3_moe_dense0": ("qwen3_moe", dict(norm_topk_prob=False, mlp_only_layers=[0])),
    "mixtral": ("mixtral", dict(num_layers=4)),
    # GLM-4.5's features (tiny_fields): the first layer dense, a shared expert, half-rotary heads, attention biases,
    # sigmoid routing with a (random, below) expert bias scaled by 2.5
    "glm4_moe": ("glm4_moe", dict(num_layers=4)),
    # GLM-4's (tiny_fields): q/k/v biases, half-rotary interleaved heads, norms after the attention and the MLP
    "glm4": ("glm4", {}),
    # DeepSeek-V3's features (tiny_fields): MLA with a query rank, YaRN with mscale, the first layer dense, a shared
    # expert, sigmoid routing over two expert groups with a random expert bias; and MLA with the query projected whole
    "deepseek_v3": ("deepseek_v3", dict(num_layers=4)),
    "deepseek_v3_q_whole": ("deepseek_v3", dict(q_lora_rank=None)),
    # scaled RoPE: Llama 3.1's (original context 16 tokens, so the rows below reach the scaled frequencies) and
    # linear scaling on Qwen2
    "llama3_rope": ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 16})),
    "qwen2_linear_rope": ("qwen2", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                         "factor": 4.0})),
    # YaRN as Qwen3's long-context checkpoints set it: new frequencies and an attention factor (0.1 ln 4 + 1)
    "qwen3_yarn": ("qwen3", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                  "original_max_position_embeddings": 16},
                                 max_position_embeddings=64)),
    # gpt-oss's features (tiny_fields): sinks, a window of 4 tokens on layers 0 and 2 (the rows below are 9 long),
    # biases everywhere, the router's bias, the clamped SwiGLU, YaRN with its attention factor and truncate false
    "gpt_oss": ("gpt_oss", dict(num_layers=4)),
    # the SwiGLU clamp reached: a limit of 0.1 clamps most gate and up values (7, as released, clamps none here)
    "gpt_oss_clamped": ("gpt_oss", dict(swiglu_limit=0.1)),
}
# (case id, model, tp, pp, ep)
CASES = [
    ("llama_tp1", "llama", 1, 1, 1), ("llama_tp2", "llama", 2, 1, 1),
    ("qwen2_tp1", "qwen2", 1, 1, 1), ("qwen2_tp2", "qwen2", 2, 1, 1),
    ("qwen3_tp1", "qwen3", 1, 1, 1), ("qwen3_tp2", "qwen3", 2, 1, 1),
    ("qwen3_moe_tp1", "qwen3_moe", 1, 1, 1), ("qwen3_moe_tp2", "qwen3_moe", 2, 1, 1),
    ("qwen3_moe_pp2", "qwen3_moe", 1, 2, 1), ("qwen3_moe_ep2", "qwen3_moe", 1, 1, 2),
    ("qwen3_moe_dense0_tp1", "qwen3_moe_dense0", 1, 1, 1),
    ("mixtral_tp1", "mixtral", 1, 1, 1), ("mixtral_tp2", "mixtral", 2, 1, 1), ("mixtral_pp2", "mixtral", 1, 2, 1),
    ("mixtral_ep2", "mixtral", 1, 1, 2),
    ("glm4_moe_tp1", "glm4_moe", 1, 1, 1), ("glm4_moe_tp2", "glm4_moe", 2, 1, 1), ("glm4_moe_pp2", "glm4_moe", 1, 2, 1),
    ("glm4_moe_ep2", "glm4_moe", 1, 1, 2),
    ("glm4_tp1", "glm4", 1, 1, 1), ("glm4_tp2", "glm4", 2, 1, 1),
    ("deepseek_v3_tp1", "deepseek_v3", 1, 1, 1), ("deepseek_v3_tp2", "deepseek_v3", 2, 1, 1),
    ("deepseek_v3_pp2", "deepseek_v3", 1, 2, 1), ("deepseek_v3_ep2", "deepseek_v3", 1, 1, 2),
    ("deepseek_v3_q_whole_tp2", "deepseek_v3_q_whole", 2, 1, 1),
    ("llama3_rope_tp1", "llama3_rope", 1, 1, 1), ("llama3_rope_tp2", "llama3_rope", 2, 1, 1),
    ("qwen2_linear_rope_tp1", "qwen2_linear_rope", 1, 1, 1), ("qwen3_yarn_tp2", "qwen3_yarn", 2, 1, 1),
    ("gpt_oss_tp1", "gpt_oss", 1, 1, 1), ("gpt_oss_tp2", "gpt_oss", 2, 1, 1), ("gpt_oss_pp2", "gpt_oss", 1, 2, 1),
    ("gpt_oss_ep2", "gpt_oss", 1, 1, 2), ("gpt_oss_clamped_tp1", "gpt_oss_clamped", 1, 1, 1),
]
TOKENS = torch.randint(2, 30, (2, 9), generator=torch.Generator().manual_seed(5))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def save_random_model(path: str, family: str, **fields) -> str:
    """A tiny checkpoint whose every tensor is random (norm weights around 1, biases non-zero), so a swapped q/k
    norm or a misplaced bias changes the logprobs; config fields beyond save_tiny_model's are set afterwards."""
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {k: fields.pop(k) for k in ("vocab_size", "num_layers") if k in fields}
    save_tiny_model(path, family=family, seed=1, **sizes)
    config = AutoConfig.from_pretrained(path)
    for name, value in fields.items():
        setattr(config, name, value)
    torch.manual_seed(2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = name.endswith("norm.weight")
            p.copy_(1 + 0.3 * torch.randn(p.shape) if is_norm else 0.15 * torch.randn(p.shape))
        for name, b in model.named_buffers():  # an expert bias of 0 would let a swapped table pass
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn(b.shape))
    model.save_pretrained(path)
    return path


def _megatron_case(rank: int, case: tuple, model_dir: str) -> dict:
    """Build the real GPTModel of `case` on this rank, load it through the table, return what it holds."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel

    from glue.trainer import model as tmodel
    from glue.trainer.layer_spec import layer_spec

    _, _, tp, pp, ep = case
    hf_config = tmodel.read_hf_config(model_dir)
    # gpt-oss's expert biases: megatron-core splits no expert over TP (the family's ETP 1); else ETP = TP
    etp = family_of(hf_config).megatron_fields(hf_config).get("expert_tensor_parallel_size", tp)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    padded = padded_vocab_size(hf_config.vocab_size, tp, divisible_by=16)
    config = dataclasses.replace(tmodel.transformer_config(hf_config, tp_size=tp), pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)
    gpt = GPTModel(config=config, vocab_size=padded,
                   transformer_layer_spec=layer_spec(config, post_norms=family_of(hf_config).post_norms),
                   max_sequence_length=64, pre_process=ps.is_pipeline_first_stage(),
                   post_process=ps.is_pipeline_last_stage(), share_embeddings_and_output_weights=False,
                   position_embedding_type="rope", rotary_base=tmodel.rope_theta(hf_config), parallel_output=True,
                   rotary_percent=family_of(hf_config).rotary_percent(hf_config))
    tmodel.scale_rope(gpt, hf_config)  # what build_model does after the GPTModel
    layout = ParallelLayout.pipeline(hf_config.num_hidden_layers, tp_rank=ps.get_tensor_model_parallel_rank(),
                                     tp_size=tp, pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=pp,
                                     ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ep, padded_vocab_size=padded,
                                     etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=etp)
    real = {n: tuple(t.shape) for n, t in gpt.state_dict().items() if not n.endswith("_extra_state")}
    local = hf_to_megatron_local(tmodel.read_hf_state(model_dir), hf_config, layout)
    result = gpt.load_state_dict(local, strict=False)
    out = {"layout": layout, "real": real, "produced": {n: tuple(t.shape) for n, t in local.items()},
           "missing": [n for n in result.missing_keys if not n.endswith("_extra_state")],
           "state": {n: t.detach().clone() for n, t in gpt.state_dict().items() if not n.endswith("_extra_state")}}
    if pp == 1 and padded == hf_config.vocab_size:
        with torch.no_grad():
            out["logprobs"] = tmodel.token_logprobs(tmodel.forward_logits(gpt.eval(), TOKENS), TOKENS, 1.0)
    return out


def _rank_main(rank: int, port: int, model_dirs: dict, results: mp.Queue) -> None:
    from glue.trainer import cpu_compat

    cpu_compat.apply()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        outs = {case[0]: _megatron_case(rank, case, model_dirs[case[1]]) for case in CASES}
    except Exception as e:  # sent back so the test shows megatron's own error
        results.put(pickle.dumps((rank, f"{type(e).__name__}: {e}")))
        raise
    torch.distributed.destroy_process_group()
    results.put(pickle.dumps((rank, outs)))  # plain bytes: a queued tensor would live in this process's shm


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict:
    return {name: save_random_model(str(tmp_path_factory.mktemp(name)), family, **dict(fields))
            for name, (family, fields) in MODELS.items()}


@pytest.fixture(scope="module")
def runs(model_dirs) -> dict:
    """case id -> [rank 0's result, rank 1's result], from one pair of spawned ranks stopped by their handles."""
    ctx = rank_context()
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, model_dirs, results)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        outs = {}
        while len(outs) < 2:
            try:
                rank, out = pickle.loads(results.get(timeout=5))
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not dead, f"megatron rank(s) died with exit codes {dead}"
                continue
            assert not isinstance(out, str), f"megatron rank {rank} failed: {out}"
            outs[rank] = out
        for p in procs:
            p.join(timeout=30)
        return {case[0]: [outs[0][case[0]], outs[1][case[0]]] for case in CASES}
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_converted_names_and_shapes_are_exactly_those_of_the_real_megatron_model(runs, case):
    for rank in runs[case]:
        assert rank["produced"] == rank["real"], (
            f"only in converter: {sorted(set(rank['produced']) - set(rank['real']))[:4]}, "
            f"only in megatron: {sorted(set(rank['real']) - set(rank['produced']))[:4]}")
        assert rank["missing"] == []


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_the_real_models_own_state_converts_back_to_the_hf_checkpoint_bit_exactly(runs, model_dirs, case):
    from glue.trainer.model import read_hf_config, read_hf_state

    model_dir = model_dirs[next(c[1] for c in CASES if c[0] == case)]
    hf_state, hf_config = read_hf_state(model_dir), read_hf_config(model_dir)
    back = megatron_to_hf([r["state"] for r in runs[case]], hf_config, [r["layout"] for r in runs[case]])
    assert set(back) == set(hf_state), set(back) ^ set(hf_state)
    for name, t in hf_state.items():
        assert torch.equal(back[name], t), name


def test_the_layouts_really_split_the_model(runs):
    tp2 = runs["qwen3_moe_tp2"][1]["real"]
    assert tp2["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"] == (32, 64)  # [gate; up] halves
    assert tp2["output_layer.weight"] == (16, 64)
    pp2 = [r["real"] for r in runs["qwen3_moe_pp2"]]
    assert "embedding.word_embeddings.weight" in pp2[0] and "output_layer.weight" in pp2[1]
    assert {n.split(".")[2] for n in pp2[1] if n.startswith("decoder.layers.")} == {"0", "1"}  # global layers 2, 3
    ep2 = [r["real"] for r in runs["qwen3_moe_ep2"]]
    assert [r["layout"].ep_rank for r in runs["qwen3_moe_ep2"]] == [0, 1]
    assert {n.split(".")[6] for n in ep2[1] if ".local_experts." in n} == {"0", "1"}  # global experts 2, 3
    assert runs["llama_tp2"][0]["real"]["embedding.word_embeddings.weight"] == (16, 64)  # 30 padded to 32
    oss_tp2 = runs["gpt_oss_tp2"][1]["real"]  # sinks split with the heads; experts whole at expert TP 1
    assert oss_tp2["decoder.layers.0.self_attention.core_attention.softmax_offset"] == (2,)
    assert oss_tp2["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"] == (64, 64)
    assert oss_tp2["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.bias"] == (64,)
    dense0 = runs["qwen3_moe_dense0_tp1"][0]["real"]
    assert "decoder.layers.0.mlp.linear_fc1.weight" in dense0 and "decoder.layers.1.mlp.router.weight" in dense0


@pytest.mark.parametrize("case", [c[0] for c in CASES if "_pp" not in c[0] and c[0].startswith(
    ("qwen2", "qwen3", "mixtral", "glm4", "deepseek_v3", "llama3", "gpt_oss"))])
def test_megatron_loaded_through_the_table_gives_the_hf_models_logprobs(runs, model_dirs, case):
    from transformers import AutoModelForCausalLM

    model_dir = model_dirs[next(c[1] for c in CASES if c[0] == case)]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(hf(TOKENS).logits.float(), dim=-1)
    expected = logp[:, :-1].gather(-1, TOKENS[:, 1:, None])[..., 0]
    got = runs[case][0]["logprobs"][:, :-1]
    assert expected.std() > 0.3, "the check needs logprobs that vary"
    diff = (got - expected).abs().max().item()
    assert diff < 1e-5, f"{case}: megatron vs HF logprobs differ by {diff}"
