"""Mixtral: LLaMA's decoder with a mixture of SwiGLU experts in place of its feed-forward
(Jiang et al., 2024), a top-k router choosing each token's experts.

Made as a copy of the LLaMA folder: the decoder-only user paths are shared
(`model_zoo.causal_lm`), so this folder holds the model (`model.py`), its Hugging Face
conversion (`convert.py`), the bindings (`tasks.py`: its hooks, the model-folder contract of
model_zoo/models/base.py; `commands.py`: its verbs) and configs.
"""
