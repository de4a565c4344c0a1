"""Offline check and cost of a parallel layout: `model-zoo plan CONFIG [--device-num N]`.

MindSpore checks operator strategies only when it compiles on Ascend, so a wrong strategy,
or a layout that does not fit in device memory, shows up after a cluster job has queued
and started. This package finds both on a laptop, for any device count:

- `trace`: records every primitive call of the training network's forward pass at real
  shapes, computing nothing (`shapes` holds the shape rules);
- `layouts`: how each operator leaves its outputs split, matmul dimensions, device matrices;
- `rules`: MindSpore's strategy rules (docs/mindspore-parallel-rules.md, tags G1-G11) on
  the layout and on every recorded call;
- `cost`: memory per device, communication and compute per step;
- `report`: `build_plan`, the text and JSON report; `command`: `model-zoo plan`;
- `docs`: the generated sections of docs/parallelism.md.
"""
