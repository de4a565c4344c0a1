"""The layouts MindSpore compiled, held against the plan's: what a compiled step's
`parameter_layout_dict` says of each parameter (device matrix, tensor map, optimizer
shard), where it differs from the layout the layout tracer recorded, and the check that
stops a sharded run whose gradient-norm weights (`replication.norm_weights`, computed from
the tracer's layouts before the compile) would not match what MindSpore compiled."""

import math
import re

from model_zoo.errors import UserInputError

WORLD_GROUPS = ("nccl_world_group", "hccl_world_group")


def named_group_size(group: str, device_num: int) -> int:
    """Ranks of a group known by its name alone: the world group's, or the size MindSpore
    puts in front of a sub-group's name ("<size>-<hash>"); 0 when the name does not say."""
    if group in WORLD_GROUPS:
        return device_num
    match = re.match(r"(\d+)-", group)
    return int(match.group(1)) if match else 0


def layout_of(layout, device_num: int) -> dict:
    """A `parameter_layout_dict` entry as plain values: device matrix, tensor map, the
    model-parallel slice this rank holds, the whole shape, and the optimizer shard's group
    size (1 without it), read from the group's name (`named_group_size`).
    Entry fields: MindSpore's `parallel/_tensor.py` (`_load_tensor_by_layout`)."""
    group = layout[5]
    return {"dev_matrix": list(layout[0]), "tensor_map": list(layout[1]),
            "slice_shape": list(layout[2]), "full_shape": list(layout[6]),
            "optimizer_shard": named_group_size(group, device_num) if group else 1}


def mindspore_split(layout: dict) -> tuple:
    """Per tensor dimension, the number of slices MindSpore cut it into."""
    dev_matrix = layout["dev_matrix"]
    return tuple(dev_matrix[len(dev_matrix) - 1 - axis] if axis >= 0 else 1
                 for axis in layout["tensor_map"])


def compare_layouts(layouts: dict, plan_params: dict, parallel, stage: int) -> list:
    """The entries of one rank whose layout MindSpore and the plan see differently.

    `layouts` are MindSpore's (`layout_of`, by checkpoint name); each names a
    parameter or its training state (`adam_m.<p>`, `adam_v.<p>`, `accu_grads.<p>`), laid
    out like the parameter. Compared: the split of every dimension, the optimizer shard's
    group, the whole shape and the stage; a differing trainable parameter also carries the
    gradient-norm weight the train step gives its slice (`replication.norm_weights`) and
    the one MindSpore's layout implies. Scalars (step counters, the loss scale) are in
    neither. A parameter of this stage that MindSpore did not lay out is reported too."""
    from model_zoo.parallel.replication import norm_weights, split_of
    from model_zoo.parallel.strategy_file import entry_layout, laid_out_names

    mismatches = []
    known = laid_out_names(plan_params, layouts)
    for name, layout in sorted(layouts.items()):
        if name not in known:
            if math.prod(layout["full_shape"]) > 1:
                mismatches.append({"parameter": name, "problem": "not in the plan",
                                   "mindspore": mindspore_view(layout), "plan": None})
            continue
        param = plan_params[known[name]]
        _, _, _, shard = entry_layout(name, param, parallel)
        plan_view = {"split": list(split_of(param)), "optimizer_shard": max(shard, 1),
                     "stage": param.stage}
        ms_view = mindspore_view(layout)
        problems = []
        if ms_view["split"] != plan_view["split"]:
            problems.append("split")
        if ms_view["optimizer_shard"] != plan_view["optimizer_shard"]:
            problems.append("optimizer shard")
        if list(layout["full_shape"]) != list(param.shape):
            problems.append("shape")
        if param.stage != stage and stage not in param.used_on_stages:
            problems.append("stage")
        if not problems:
            continue
        entry = {"parameter": name, "problem": ", ".join(problems), "mindspore": ms_view,
                 "plan": plan_view}
        if name == known[name] and param.requires_grad:
            # a parameter's gradient is counted on its own stage only (other stages: 0)
            entry["norm_weight"] = norm_weights([param], parallel, stage)[0]
            copies = math.prod(layout["dev_matrix"]) // max(1, math.prod(ms_view["split"]))
            entry["norm_weight_mindspore"] = (ms_view["optimizer_shard"] / max(1, copies)
                                              if param.stage == stage else 0.0)
        mismatches.append(entry)
    unplaced = [name for name, param in plan_params.items()
                if param.stage == stage and name not in layouts]
    for name in sorted(unplaced):
        mismatches.append({"parameter": name, "problem": "not laid out by MindSpore",
                           "mindspore": None, "plan": {"split": list(split_of(
                               plan_params[name])), "stage": stage}})
    return mismatches


def mindspore_view(layout: dict) -> dict:
    return {"split": list(mindspore_split(layout)), "optimizer_shard": layout["optimizer_shard"],
            "dev_matrix": layout["dev_matrix"], "tensor_map": layout["tensor_map"]}


def check_compiled_layouts(parameter_layout_dict, planned: dict, parallel, rank: int):
    """UserInputError naming the first parameter of `planned` ({name: the layout tracer's
    ParamInfo} of the parameters the gradient norm weights) whose layout MindSpore
    compiled (`parameter_layout_dict`, a compiled cell's) differs from the one its weight
    was computed from: the clipping and the overflow decision would be wrong."""
    from model_zoo.parallel.replication import stage_of_rank
    layouts = {name: layout_of(value, parallel.device_num)
               for name, value in parameter_layout_dict.items() if name in planned}
    wrong = compare_layouts(layouts, planned, parallel, stage_of_rank(rank, parallel))
    if wrong:
        first = wrong[0]
        raise UserInputError(
            f"the layout MindSpore compiled for {first['parameter']}, "
            f"{short_view(first['mindspore'])}, is not the one its gradient-norm weight was "
            f"computed from, {short_view(first['plan'])} (the {first['problem']} differs); "
            f"the clipping would be wrong, so the run stops before step 1 ({len(wrong)} "
            f"parameter(s) differ; `model-zoo dryrun` with this config lists them)")


def short_view(view) -> str:
    """A layout as the reports say it: split per dimension, and the optimizer shard."""
    if view is None:
        return "none"
    text = f"split {tuple(view['split'])}"
    if view.get("optimizer_shard", 1) > 1:
        text += f" optimizer shard {view['optimizer_shard']}"
    return text
