"""The model folders: one sub-package per model (`gpt2`, `bert`, `transformer`, `llama`,
`mixtral`), each providing the contract of `model_zoo.models.base`: its hooks in `tasks.py`,
its verbs in `commands.py`. Copying a folder under a new name makes a new model; nothing
else registers it."""
