"""Mixtral's verbs on the command line: `generate`, as every decoder-only model has it."""

from model_zoo.causal_lm import commands

add_commands = commands.add_commands
