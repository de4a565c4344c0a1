"""Checkpoints: what a training checkpoint holds (`contents`), saving and loading one rank's
(`files`), moving them between layouts (`layouts`), resuming a run on the same or another
layout (`resume`), and the `model-zoo checkpoint` command line (`command`)."""
