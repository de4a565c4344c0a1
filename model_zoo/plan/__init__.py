"""`model-zoo plan` and `model-zoo advise` as a user sees them: the report (`report`), the
generated sections of docs/parallelism.md (`docs`), the commands (`command`) and the launch
scripts' layout step (`launch`). The work is done below: the layout tracer
(`model_zoo.layout`) and the cost model (`model_zoo.cost`).
"""
