"""Mixtral's part of the command line (imported for `--help`, so nothing heavy): the
`generate` verb every decoder-only model has, and `model-zoo data|convert <this folder>`."""

from model_zoo.causal_lm import commands

SUBCOMMANDS = ("data", "convert")   # served by tasks.py
add_commands = commands.add_commands
