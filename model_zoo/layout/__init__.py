"""The layout tracer: what MindSpore will make of a config's parallel section.

It records the training network's forward pass at real shapes without computing
(`trace`, into a `recording`), knows each operator's shapes, output layouts and strategy
rule (`operators`, with the entries in `elementwise` and `contracting`, an entry's fields
in `operator_entry`), and checks MindSpore's strategy rules (`rules`); `network` does all
of it for a config. The trainer (gradient-norm weights), checkpoints (slices) and the cost
model (`model_zoo.cost`) read it; it imports none of them.
"""
