"""Code deliberately copied between model folders (a folder never imports another, so a copy
of it stays a model of its own) carries `# Copied from model_zoo.models.X.module.Name[.attr]`
on the line above it, optionally with `with Old->New` renames; this test checks each copy
is still identical to its original, as Hugging Face's `check_copies` does. A marker naming
a module (`# Copied from model_zoo.models.X.module`) covers the lines after it up to the
next blank line, which must stand in that module as they are."""

import importlib
import inspect
import os
import re
import textwrap

import model_zoo.models

MARKER = re.compile(r"^(?P<indent>\s*)# Copied from (?P<target>[\w.]+)(?: with (?P<renames>.*))?$")
PACKAGE_DIR = os.path.dirname(model_zoo.models.__path__[0])


def resolve(target: str):
    """The object a dotted name points at: the longest importable module, then attributes."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            value = inspect.getattr_static(value, attribute)
        return value.fget if isinstance(value, property) else value
    raise ImportError(target)


def block_after(lines, start: int, indent: str) -> str:
    """The definition (with its decorators) starting at lines[start], up to its dedent."""
    block, index = [], start
    while lines[index].startswith(indent + "@"):
        block.append(lines[index])
        index += 1
    block.append(lines[index])                      # the def or class line
    for line in lines[index + 1:]:
        if line.strip() and not line.startswith(indent + " "):
            break
        block.append(line)
    while block and not block[-1].strip():
        block.pop()
    return "\n".join(block)


def lines_after(lines, start: int) -> str:
    """The lines from lines[start] up to the next blank line (a module-level copy)."""
    block = []
    for line in lines[start:]:
        if not line.strip():
            break
        block.append(line)
    return "\n".join(block)


def original_source(value) -> str:
    """The original's source (decorators included), dedented."""
    return textwrap.dedent(inspect.getsource(value)).rstrip()


def copies():
    """(path, line number, marker match, copied block) of every marker under model_zoo/;
    a line that mentions "Copied from" but is not a well-formed marker fails."""
    found = []
    for root, _, files in sorted(os.walk(PACKAGE_DIR)):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            with open(path, encoding="utf-8") as handle:
                lines = handle.read().splitlines()
            for number, line in enumerate(lines):
                match = MARKER.match(line)
                assert match or "Copied from" not in line or path == __file__, (
                    f"{path}:{number + 1}: malformed marker {line.strip()!r}")
                if match:
                    found.append((path, number + 1, match, lines))
    return found


def test_copies_are_identical_to_their_originals():
    found = copies()
    assert len(found) >= 2
    for path, number, match, lines in found:
        original = resolve(match["target"])
        expected = original_source(original)
        for rename in (match["renames"] or "").split(","):
            if "->" in rename:
                old, new = (part.strip() for part in rename.split("->"))
                expected = expected.replace(old, new)
        where = f"{os.path.relpath(path, PACKAGE_DIR)}:{number}"
        if inspect.ismodule(original):
            block = lines_after(lines, number)
            assert block and ("\n" + block + "\n") in ("\n" + expected + "\n"), (
                f"{where}: these lines no longer stand in {match['target']}: make them equal "
                f"again or drop the marker")
            continue
        block = block_after(lines, number, match["indent"])
        assert textwrap.dedent(block).rstrip() == expected, (
            f"{where} is no longer a copy of {match['target']}: make them equal again or "
            f"drop the marker")


def test_the_comparison_catches_a_change():
    """The block reader and the comparison on a synthetic copy: equal when equal, not when
    one character differs, decorators included."""
    original = "@property\ndef size(self):\n    return 4 * self.hidden\n"
    lines = ["class A:", "    # Copied from x.y", "    @property", "    def size(self):",
             "        return 4 * self.hidden", "", "    def other(self):", "        pass"]
    block = textwrap.dedent(block_after(lines, 2, "    ")).rstrip()
    assert block == original.rstrip()
    assert block.replace("4", "5") != original.rstrip()


def test_a_module_level_copy_ends_at_the_blank_line():
    lines = ["# Copied from x", "a = tasks.a", "b = tasks.b", "", "c = 1"]
    assert lines_after(lines, 1) == "a = tasks.a\nb = tasks.b"
