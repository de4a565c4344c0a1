"""A model zoo for MindSpore: classic models whose operators carry sharding strategies.

One YAML config moves a model between data, operator-level model, pipeline and optimizer
parallelism on Ascend clusters; the same code trains on a laptop CPU.
"""

__version__ = "0.1.0"
