"""Starting a job: HCCL rank tables (`rank_table`) and the local multi-process launcher
(`local`, also `python -m model_zoo.launch`). Nothing here imports MindSpore, so the launch
scripts' checks start at once."""
