"""Install the model zoo: `pip install -e .` (add `[dev]` for the tests and references)."""

from setuptools import find_packages, setup

setup(
    name="mindspore-model-zoo",
    version="0.1.0",
    description="Classic models for MindSpore with operator-level sharding strategies",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.9",
    packages=find_packages(include=["model_zoo", "model_zoo.*"]),
    package_data={"model_zoo": ["models/*/configs/*.yaml", "models/*/configs/*/*.yaml",
                                "cost/device_profiles/*.yaml", "cost/measurements/*.csv",
                                "models/*/README.md", "nn/cpu_kernels.cc"]},
    install_requires=[
        "mindspore==2.10.0",
        "numpy<2",
        "pyyaml",
        "sentencepiece",
        "matplotlib",
        "safetensors",
        "tokenizers",
        "sacrebleu",   # the Transformer's evaluation (BLEU), run at the end of its training
    ],
    extras_require={
        "dev": ["pytest", "ruff", "torch==2.13.0", "transformers"],
    },
    entry_points={"console_scripts": ["model-zoo=model_zoo.cli:main"]},
)
