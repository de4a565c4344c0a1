"""The model folders: one sub-package per model (`gpt2`, `bert`, `transformer`), each
providing the hooks of `model_zoo.models.base.ModelFolder`. Copying a folder under a new
name makes a new model; nothing else registers it."""
