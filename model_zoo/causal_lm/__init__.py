"""What decoder-only model folders share: their dataset (`data`), user paths (`tasks`),
cached generation (`generate`) and the `generate` verb (`commands`). A folder binds them to
its own model (see `model_zoo/models/gpt2/tasks.py`); nothing here imports MindSpore at
package level."""
