"""MindSpore's own dry run of a layout (`model-zoo dryrun`): every chosen rank's partitioned
graph compiled by MindSpore's semi-auto-parallel compiler on this machine
(`MS_SIMULATION_LEVEL=0` on the wheel's GPU plugin, against generated CUDA stubs), its
strategy file held against the plan's layouts, and the partitioned graphs run on CPU ranks.

- `run`: the command's work (ranks, processes, comparison with the plan, the report);
- `rank`: one rank's compile, in its own process;
- `cuda_stubs`: the stub CUDA libraries the GPU plugin loads;
- `cpu_ranks`: the exported partitioned graphs run on CPU ranks with real collectives;
- `numbers`: `--check-numbers`, those steps against one device's;
- `command`: the command line.
"""
