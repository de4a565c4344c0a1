"""The rooms of the house and the one-way doors between them (docs/architecture.md), read
from the source: every import of every module, at any depth of a function."""

import ast
import os

import model_zoo

ROOT = os.path.dirname(model_zoo.__file__)

# package -> the packages it must not import (allowed modules of them in EXCEPTIONS)
FORBIDDEN = {
    "parallel": {"train", "checkpoint", "layout", "cost", "plan", "dryrun"},
    "layout": {"train", "checkpoint", "cost", "plan", "dryrun"},
    "checkpoint": {"train", "cost", "plan", "dryrun"},
    "train": {"cost", "plan", "dryrun"},
    "cost": {"train", "checkpoint", "plan", "dryrun"},
    "dryrun": {"plan"},
}
EXCEPTIONS = {}
PLANNER_PACKAGES = ("layout", "cost", "plan", "dryrun")
MAX_MODULE_LINES = 600


def module_files():
    """{dotted module name: path} of every module of model_zoo."""
    found = {}
    for folder, _, names in os.walk(ROOT):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = "model_zoo." + os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def import_graph():
    """{module: the model_zoo modules it imports}; `from package import module` names the
    module, `from module import name` the module."""
    files = module_files()
    graph = {}
    for module, path in files.items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    imported.add(target if target in files else node.module)
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
        graph[module] = {name for name in imported if name in files} - {module}
    return graph


def package_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    state, path = {}, []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_imports_go_one_way():
    """Training (train, checkpoint, parallel) reaches the planner only through the layout
    tracer; the tracer knows nothing of costs, reports or the dry run; the cost model
    nothing of reports, the dry run or training."""
    wrong = []
    for module, targets in import_graph().items():
        forbidden = FORBIDDEN.get(package_of(module), set())
        exceptions = EXCEPTIONS.get(package_of(module), set())
        wrong += [f"{module} imports {target}" for target in sorted(targets)
                  if package_of(target) in forbidden and target not in exceptions]
    assert not wrong, "\n".join(wrong)


def test_the_graph_sees_function_level_imports():
    """The checks above would pass on a reader that misses imports inside functions: the
    trainer's import of the tracer is inside a function."""
    graph = import_graph()
    assert "model_zoo.layout.network" in graph["model_zoo.train.trainer"]
    assert "model_zoo.layout.network" in graph["model_zoo.checkpoint.layouts"]


def test_planner_modules_stay_short():
    long = [f"{path}: {count} lines" for path, count in
            ((path, sum(1 for _ in open(path, encoding="utf-8")))
             for module, path in module_files().items()
             if package_of(module) in PLANNER_PACKAGES)
            if count >= MAX_MODULE_LINES]
    assert not long, "\n".join(long)
