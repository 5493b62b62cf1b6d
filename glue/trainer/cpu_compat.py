"""Bridges the few CUDA-only spots of megatron-core 0.16 so the trainer runs the same code on CPU (gloo).

`apply()` is called once per process before megatron-core builds anything; with CUDA it does nothing.
Every patch keeps megatron's own logic and only swaps a CUDA device or CUDA RNG for the CPU one.
"""
from __future__ import annotations

import contextlib
import operator
import types
from functools import reduce
from typing import Any

import torch

_applied = False


def is_cpu_only() -> bool:
    """True when this process has no CUDA device, i.e. when the patches are needed."""
    return not torch.cuda.is_available()


def apply() -> None:
    """Install the CPU bridges (idempotent); a no-op when CUDA is available."""
    global _applied
    if _applied or not is_cpu_only():
        return
    _patch_rng_tracker()
    _patch_rotary_embedding()
    _patch_global_memory_buffer()
    _patch_default_causal_mask()
    _patch_moe_router()
    _patch_first_dim_collectives()
    _patch_parallel_linear_backward()
    _patch_pipeline_schedules()
    _patch_tied_embedding_sync()
    _patch_data_parallel_and_optimizer()
    _patch_hybrid_device_optimizer()
    _patch_dist_checkpointing()
    _applied = True


def _patch_rng_tracker() -> None:
    # Why: CudaRNGStatesTracker reads/sets torch.cuda RNG states (model_parallel_cuda_manual_seed, fork()).
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Same bookkeeping as megatron's tracker, on the CPU default generator."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    # initialize_rng_tracker() looks the class up by module global at call time.
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom.initialize_rng_tracker(force_reset=True)
    # Activation recompute (CheckpointFunction) saves and restores the CUDA generator next to the CPU one, which
    # it saves itself: on CPU there is no CUDA generator to keep.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: None
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None


def _patch_rotary_embedding() -> None:
    # Why: RotaryEmbedding.get_emb moves inv_freq to torch.cuda.current_device() on first use.
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]

    RotaryEmbedding.get_emb = get_emb

    # Why: multi-latent attention builds its RoPE (plain or YaRN) per layer without use_cpu_initialization, so their
    # __init__ make the inverse frequencies on torch.cuda.current_device(), and YaRN's get_emb moves them there on
    # first use. Same bytecode, run with a CPU `torch`.
    from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding as yarn

    RotaryEmbedding.__init__ = _on_cpu_torch(RotaryEmbedding.__init__, rotary_pos_embedding)
    for name in ("__init__", "get_emb"):
        setattr(yarn.YarnRotaryEmbedding, name, _on_cpu_torch(getattr(yarn.YarnRotaryEmbedding, name), yarn))


def _patch_global_memory_buffer() -> None:
    # Why: GlobalMemoryBuffer.get_tensor (attention score buffer) allocates on torch.cuda.current_device().
    from megatron.core.utils import GlobalMemoryBuffer

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        required_len = reduce(operator.mul, tensor_shape, 1)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < required_len:
            buf = self.buffer[(name, dtype)] = torch.empty(required_len, dtype=dtype, device="cpu")
        return buf[0:required_len].view(*tensor_shape)

    GlobalMemoryBuffer.get_tensor = get_tensor


def _patch_default_causal_mask() -> None:
    # Why: get_default_causal_mask builds the mask on "cuda" when no explicit mask is passed.
    from megatron.core.fusions import fused_softmax

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    fused_softmax.get_default_causal_mask = get_default_causal_mask


def _patch_moe_router() -> None:
    # Why: Router.gating moves CPU router weights to torch.cuda.current_device(), and the gating matmul reads
    # `te_general_gemm`, which moe_utils only defines when Transformer Engine imports.
    from megatron.core.transformer.moe import moe_utils, router

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        return moe_utils.router_gating_linear(input, self.weight, self.bias, dtype)

    router.Router.gating = gating

    # Why: TopKRouter.__init__ puts the expert-bias buffers (sigmoid routers: DeepSeek-V3, GLM-4.5) on
    # torch.cuda.current_device(). Same bytecode, run with a CPU `torch`.
    router.TopKRouter.__init__ = _on_cpu_torch(router.TopKRouter.__init__, router)


class _HostStream:
    """A CUDA stream as the CPU has it: work runs in program order, so waiting on a stream or an event, and recording
    one, have nothing left to do."""

    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self) -> "_HostStream":
        return self  # the event: synchronize() and wait(stream) return at once

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass


_HOST_STREAM = _HostStream()


class _TorchOnCpu(types.ModuleType):
    """`torch` as seen by a patched megatron function: the same module, except that the current device is the CPU
    (there is nothing to synchronize, its one stream runs in program order), a tensor `zeros` puts on "cuda" is put
    on the CPU, and host memory asked for pinned is plain host memory (pinning needs CUDA)."""

    cuda = types.SimpleNamespace(current_device=lambda: "cpu", synchronize=lambda *args: None,
                                 empty_cache=lambda: None, is_available=lambda: False,
                                 current_stream=lambda *args: _HOST_STREAM, Stream=lambda *args, **kwargs: _HOST_STREAM,
                                 stream=lambda stream: contextlib.nullcontext())

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)

    @staticmethod
    def empty(*args, device=None, pin_memory=False, **kwargs):
        return torch.empty(*args, device="cpu" if device == "cuda" else device, **kwargs)

    def __getattr__(self, name):
        return getattr(torch, name)


def _patch_first_dim_collectives() -> None:
    # Why: the first-dim all-gather / reduce-scatter (sequence parallel, the MoE all-gather token dispatcher at
    # TP or EP > 1) allocate their outputs on torch.cuda.current_device(). Same bytecode, run with a CPU `torch`.
    from megatron.core.tensor_parallel import mappings

    for name in ("_gather_along_first_dim", "_reduce_scatter_along_first_dim", "_gather_along_last_dim"):
        setattr(mappings, name, _on_cpu_torch(getattr(mappings, name), mappings))


def _on_cpu_torch(f: Any, module: Any) -> Any:
    """`f`, a function of megatron's `module`, with the same bytecode run against the CPU `torch` (_TorchOnCpu)."""
    patched = types.FunctionType(f.__code__, {**vars(module), "torch": _TorchOnCpu("torch")}, f.__name__,
                                 f.__defaults__, f.__closure__)
    patched.__kwdefaults__ = f.__kwdefaults__
    return patched


def _patch_parallel_linear_backward() -> None:
    # Why: under sequence parallelism the parallel linears' backward allocates its all-gather buffer on
    # torch.cuda.current_device(). Every runtime use of torch.cuda in that module is that call, so the module's
    # functions see the CPU `torch` as a whole.
    from megatron.core.tensor_parallel import layers

    layers.torch = _TorchOnCpu("torch")


def _patch_pipeline_schedules() -> None:
    # Why: the pipeline p2p code allocates shape and activation buffers on torch.cuda.current_device() and calls
    # torch.cuda.synchronize() after batched send/recv; the schedules count tokens in a tensor made on "cuda".
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    p2p_communication.torch = _TorchOnCpu("torch")
    schedules.torch = _TorchOnCpu("torch")


def _patch_tied_embedding_sync() -> None:
    # Why: with tied embeddings and PP > 1, the last stage's copy of the embedding is synced from the first stage
    # by an all-reduce of `weight.data.cuda()`. On CPU the tensor stays where it is for the duration of that setup.
    from megatron.core.models.common.language_module.language_module import LanguageModule

    setup = LanguageModule.setup_embeddings_and_output_layer

    def setup_on_cpu(self) -> None:
        to_cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
        try:
            setup(self)
        finally:
            torch.Tensor.cuda = to_cuda

    LanguageModule.setup_embeddings_and_output_layer = setup_on_cpu


# CUDA constants in megatron's code and what they mean on the CPU: the device literal and the legacy tensor type
# names that `tensor.type()` is compared with (a CPU tensor's type() is e.g. "torch.BFloat16Tensor").
_CPU_CONSTANTS = {"cuda": "cpu", "torch.cuda.FloatTensor": "torch.FloatTensor",
                  "torch.cuda.HalfTensor": "torch.HalfTensor", "torch.cuda.BFloat16Tensor": "torch.BFloat16Tensor"}


def _cpu_constant(value: object) -> object:
    if isinstance(value, str):
        return _CPU_CONSTANTS.get(value, value)
    if isinstance(value, tuple):  # `x.type() in ["torch.cuda.HalfTensor", ...]` compiles to a tuple constant
        return tuple(_cpu_constant(v) for v in value)
    if isinstance(value, frozenset):
        return frozenset(_cpu_constant(v) for v in value)
    if isinstance(value, types.CodeType):  # nested functions, lambdas, comprehensions
        return value.replace(co_consts=tuple(_cpu_constant(c) for c in value.co_consts))
    return value


def _constants_on_cpu(function: Any) -> None:
    """Rewrite `function`'s CUDA constants in place (every reference to it sees the CPU version)."""
    function.__code__ = _cpu_constant(function.__code__)


def _module_on_cpu(module: types.ModuleType) -> None:
    """Every function and method written in `module` with its CUDA constants rewritten (decorated ones through
    their `__wrapped__`), and `torch` as the module sees it answering torch.cuda.current_device() / synchronize /
    empty_cache for the CPU."""
    module.torch = _TorchOnCpu("torch")
    for obj in list(vars(module).values()):
        members = vars(obj).values() if isinstance(obj, type) else [obj]
        for member in members:
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            accessors = [member.fget, member.fset] if isinstance(member, property) else [member]
            for function in accessors:
                while function is not None:
                    code = getattr(function, "__code__", None)
                    if isinstance(function, types.FunctionType) and code.co_filename == module.__file__:
                        _constants_on_cpu(function)
                    function = getattr(function, "__wrapped__", None)


def _patch_data_parallel_and_optimizer() -> None:
    # Why: megatron's DistributedDataParallel puts its contiguous gradient (and parameter) buffers on
    # torch.cuda.current_device(); its optimizers make their loss-scale / overflow / grad-norm scalars on "cuda" and
    # recognise model parameters by their CUDA type names (torch.cuda.BFloat16Tensor ...); the grad-norm fallback
    # without apex (core.utils.local_multi_tensor_l2_norm) returns its norm on "cuda". Same code, CPU constants.
    from megatron.core import utils
    from megatron.core.distributed import distributed_data_parallel, param_and_grad_buffer
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    for module in (param_and_grad_buffer, distributed_data_parallel, distrib_optimizer, optimizer, clip_grads):
        _module_on_cpu(module)
    _constants_on_cpu(utils.local_multi_tensor_l2_norm)


def _patch_hybrid_device_optimizer() -> None:
    # Why: megatron's HybridDeviceOptimizer (--optimizer-cpu-offload) tells device from host tensors by `is_cuda`,
    # pins its host copies, overlaps the copies on CUDA streams and moves loaded state back with `.to("cuda")`. On
    # the CPU the tensors the distributed optimizer hands it (the model's shards) stand for the device ones and its
    # host copies for the host: the split by `optimizer_offload_fraction`, the gradient copies to the host, the
    # CPU sub-optimizer and the copy back to the model all run as on a GPU. Same code, CPU stream and constants.
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    _module_on_cpu(hybrid_optimizer)
    hybrid_optimizer.HybridDeviceOptimizer._get_sub_optimizer_param_groups = _sub_optimizer_param_groups_on_cpu


def _sub_optimizer_param_groups_on_cpu(self, offload_fraction: float):
    """megatron's `HybridDeviceOptimizer._get_sub_optimizer_param_groups` with every parameter it was given counted
    as a device tensor and every host copy it makes as a host one (no pinning)."""
    params = [param for group in self.param_groups for param in group["params"]]
    offload_threshold = sum(param.numel() for param in params) * offload_fraction
    offload_params_numel = 0
    cpu_param_groups, gpu_param_groups = [], []
    gpu_params_map_cpu_copy, cpu_copys_map_gpu_param, param_to_fp32_param = {}, {}, {}
    for group in self.param_groups:
        gpu_group, cpu_group = {**group, "params": []}, {**group, "params": []}
        for param in group["params"]:
            orig_param = param
            cpu_copy = False
            if offload_params_numel < offload_threshold:
                param = param.detach().clone()
                offload_params_numel += param.numel()
                cpu_copy = True
            if self.param_update_in_fp32 and param.dtype != torch.float32:
                param = param.detach().clone().float()
                param_to_fp32_param[orig_param] = param
            if cpu_copy:
                gpu_params_map_cpu_copy[orig_param] = param
                cpu_copys_map_gpu_param[param] = orig_param
            (cpu_group if cpu_copy else gpu_group)["params"].append(param)
        if gpu_group["params"]:
            gpu_param_groups.append(gpu_group)
        if cpu_group["params"]:
            cpu_param_groups.append(cpu_group)
    return cpu_param_groups, gpu_param_groups, gpu_params_map_cpu_copy, cpu_copys_map_gpu_param, param_to_fp32_param


def _patch_dist_checkpointing() -> None:
    # Why: megatron's dist_checkpointing synchronises CUDA before it copies tensors out for writing and exchanges its
    # validation flags in tensors made on the current CUDA device. Same code, CPU constants.
    from megatron.core.dist_checkpointing.strategies import async_utils, filesystem_async, state_dict_saver

    for module in (filesystem_async, state_dict_saver, async_utils):
        _module_on_cpu(module)
