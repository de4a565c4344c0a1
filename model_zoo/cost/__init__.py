"""The cost model: memory, communication, compute and step time of a layout on a device
profile, from the layout tracer's recording (`model_zoo.layout`).

- `memory`, `communication`, `compute`: per device and pipeline stage, per step;
- `devices` (with `device_profiles/`) and `timing`: the step time on a device;
- `calibration` (with `measurements/`): published runs, fitted and checked;
- `build`: `build_plan`, a config checked and costed (what `model-zoo plan` reports);
- `advisor`: `model-zoo advise`, the layouts ranked by predicted throughput.
"""
