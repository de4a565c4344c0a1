"""LLaMA: a decoder-only language model with rotary positions, RMSNorm, SwiGLU and
grouped-query attention.

Made as a copy of the GPT-2 folder: the decoder-only user paths are shared
(`model_zoo.causal_lm`), so this folder holds the model (`model.py`), its Hugging Face
conversion (`convert.py`), the bindings (`tasks.py`: its hooks, the model-folder contract of
model_zoo/models/base.py; `commands.py`: its verbs) and configs.
"""
