"""Which implementation each building block runs, chosen in one place.

A layer built now runs either MindSpore's operators, which carry the strategies semi-auto
parallel reads (Ascend, GPU, and the plan check, which builds under `kernels_for("Ascend",
described_only=True)`), or, on CPU, a fused kernel of `cpu_kernels`: the same math, faster
there, and no strategy (CPU runs ignore strategies anyway). `CPU_KERNELS` lists the
blocks that have one and what each needs; `cpu_kernel` is where every layer, the loss, the
decoders and the train step ask for it. A new kernel is one entry here, and its layer
asks `cpu_kernel` by name.

The parts a layer calls (`linear_product`, `norm`, `residual_add`, `attention_core_name`,
`decode_block`) are handed out here once, when the layer is built: the layer builds its
operators part with its strategies, and gets that back, or the CPU part that replaces it
with the same call. A layer's `construct` calls its part and never asks which it has.
"""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import mindspore as ms
from mindspore import nn

from model_zoo.nn import cpu_kernels

_KERNEL_TARGETS = []   # (device target, described only)


@contextmanager
def kernels_for(device_target: str, described_only: bool = False):
    """Build layers with the kernels of `device_target` instead of the current one's;
    `described_only`: to be recorded by the plan (shapes and strategies), never run here."""
    _KERNEL_TARGETS.append((device_target, described_only))
    try:
        yield
    finally:
        _KERNEL_TARGETS.pop()


def kernel_target() -> str:
    """The device whose operators layers built now use (`kernels_for`, else the context's)."""
    return _KERNEL_TARGETS[-1][0] if _KERNEL_TARGETS else ms.get_context("device_target")


def use_cpu_kernels() -> bool:
    """Whether layers built now use the fused kernels of `cpu_kernels` (CPU target, and the
    kernels could be compiled) instead of MindSpore's operators."""
    return kernel_target() == "CPU" and cpu_kernels.available()


def batch_products_broadcast() -> bool:
    """Whether BatchMatMul may take a weight of fewer batch dimensions than its input: an
    Ascend build that runs on Ascend, or that the plan only describes; MindSpore's CPU and
    GPU kernels refuse one ("inputs shape cannot be broadcast on CPU/GPU"), so an Ascend
    build that runs elsewhere does not (the dry run's compile on the GPU plugin, the
    numbers check's one device on CPU)."""
    described = bool(_KERNEL_TARGETS) and _KERNEL_TARGETS[-1][1]
    return kernel_target() == "Ascend" and (described
                                            or ms.get_context("device_target") == "Ascend")


@dataclass(frozen=True)
class CpuKernel:
    """How to make one block's fused CPU kernel, and what it needs besides a CPU target."""
    make: Callable
    float32_only: bool = False    # the block's compute dtype must be float32
    needs_onednn: bool = False    # it calls MindSpore's oneDNN (`cpu_kernels.has_dense`)


CPU_KERNELS = {
    # dense layers: oneDNN's sgemm for training and evaluation, a one-pass matmul for the
    # few rows of a decoding step, the bias where oneDNN does not add it
    "dense": CpuKernel(cpu_kernels.dense, float32_only=True, needs_onednn=True),
    "few_rows_dense": CpuKernel(cpu_kernels.skinny_matmul, float32_only=True),
    "bias_add": CpuKernel(cpu_kernels.bias_add, float32_only=True),
    "gelu": CpuKernel(cpu_kernels.GELU),
    "swiglu": CpuKernel(cpu_kernels.swiglu, float32_only=True),
    "moe_experts": CpuKernel(cpu_kernels.moe_experts, float32_only=True, needs_onednn=True),
    "layer_norm": CpuKernel(cpu_kernels.layer_norm),
    "rms_norm": CpuKernel(cpu_kernels.rms_norm),
    "add": CpuKernel(cpu_kernels.add, float32_only=True),
    "dropout": CpuKernel(cpu_kernels.keyed_dropout),
    "rotary": CpuKernel(cpu_kernels.rotary, float32_only=True),
    # the attention core of training and evaluation, and of a decoding step
    "self_attention": CpuKernel(cpu_kernels.self_attention, float32_only=True,
                                needs_onednn=True),
    "kv_attention": CpuKernel(cpu_kernels.kv_attention, float32_only=True, needs_onednn=True),
    "decode_attention": CpuKernel(cpu_kernels.decode_attention, float32_only=True),
    # a decoding step's block halves, norm to residual, one launch each
    "decode_block": CpuKernel(cpu_kernels.decode_block, float32_only=True),
    "reorder_cache": CpuKernel(cpu_kernels.reorder_cache, float32_only=True),
    "cross_entropy": CpuKernel(cpu_kernels.cross_entropy),
    "log_softmax_top_k": CpuKernel(cpu_kernels.log_softmax_top_k),
    # the train step: the global norm's square, and AdamW over every parameter at once
    "squared_norm": CpuKernel(cpu_kernels.squared_norm),
    "adamw_update": CpuKernel(cpu_kernels.adamw_update, float32_only=True),
}


def cpu_kernel(block: str, *args, dtype=None):
    """The fused CPU kernel that runs `block` (a key of CPU_KERNELS, made with `args`) in
    what is built now, or None where MindSpore's operators run it: another target, kernels
    that did not compile, a compute `dtype` other than float32 for a float32-only block, or
    no usable oneDNN for a block that calls it."""
    return CPU_KERNELS[block].make(*args) if runs_cpu_kernel(block, dtype) else None


def runs_cpu_kernel(block: str, dtype=None) -> bool:
    """Whether `cpu_kernel(block, ..., dtype=dtype)` hands out a kernel, without making it."""
    kernel = CPU_KERNELS[block]
    if kernel.float32_only and dtype is None:
        raise TypeError(f"cpu_kernel({block!r}) needs the block's compute dtype")
    if not use_cpu_kernels() or (kernel.float32_only and dtype != ms.float32):
        return False
    return not kernel.needs_onednn or cpu_kernels.has_dense()


# The parts a layer asks for by name: what runs on MindSpore's operators (every device, and
# the strategies semi-auto parallel reads) or, on CPU, on the fused kernels.

def attention_core_name(*, flash: bool, fused_qkv: bool, compute_dtype) -> str:
    """The attention core (`attention.ATTENTION_CORES`) of a layer built now: "flash" when
    the config asks for it (Ascend 910B), "cpu_fused" where the CPU kernels run it, else
    "dot_product" (MindSpore's operators)."""
    if flash:
        return "flash"
    fused = runs_cpu_kernel("self_attention" if fused_qkv else "kv_attention", compute_dtype)
    return "cpu_fused" if fused else "dot_product"


def decode_block(half: str, compute_dtype):
    """The kernel that runs one half of a pre-norm block at a decoding step in one launch
    (`cpu_kernels.decode_block`), or None where the layers run it."""
    return cpu_kernel("decode_block", half, dtype=compute_dtype)


class DenseProduct(nn.Cell):
    """x W^T (+ b) through oneDNN's sgemm (`cpu_kernels.dense`). Inputs as `MatMulProduct`'s."""

    def __init__(self, dense):
        super().__init__()
        self.dense = dense

    def construct(self, x, weight, bias=None):
        return self.dense(x, weight) if bias is None else self.dense(x, weight, bias)


class FewRowsProduct(nn.Cell):
    """In eval mode, at most `SKINNY_ROWS` rows (a decoding step) in one pass over the weight
    (`cpu_kernels.skinny_matmul`: MindSpore's MatMul takes 2-3 times that), other calls
    through `product`. The rows are known when the graph compiles."""

    def __init__(self, few_rows, product):
        super().__init__()
        self.few_rows, self.product = few_rows, product

    def construct(self, x, weight, bias=None):
        if self.training or x.shape[0] > cpu_kernels.SKINNY_ROWS:
            return self.product(x, weight, bias)
        return self.few_rows(x, weight) if bias is None else self.few_rows(x, weight, bias)


def linear_product(operators, has_bias: bool, compute_dtype):
    """A linear layer's product x (rows, in) W^T (+ b): `operators` (`layers.MatMulProduct`,
    with the layer's strategies), or on CPU oneDNN's sgemm and the few-rows kernel. On CPU
    without oneDNN the operators' MatMul stays and their bias addition becomes the kernel."""
    dense = cpu_kernel("dense", has_bias, dtype=compute_dtype)
    product = operators if dense is None else DenseProduct(dense)
    if dense is None and has_bias:
        operators.bias_add = cpu_kernel("bias_add", dtype=compute_dtype) or operators.bias_add
    few_rows = cpu_kernel("few_rows_dense", has_bias, dtype=compute_dtype)
    return product if few_rows is None else FewRowsProduct(few_rows, product)


class NormKernel(nn.Cell):
    """A norm on its CPU kernel: inputs (x float32, the norm's parameters, eps) as the
    operators part's, the normalised x out."""

    def __init__(self, kernel):
        super().__init__()
        self.kernel = kernel

    def construct(self, *inputs):
        return self.kernel(*inputs)[0]


def norm(kind: str, operators):
    """A norm of `kind` ("layer_norm", "rms_norm"): `operators` (its strategies), or on CPU
    its kernel."""
    kernel = cpu_kernel(kind)
    return operators if kernel is None else NormKernel(kernel)


class AddKernel(nn.Cell):
    """x + y through `cpu_kernels.add` when both are float32, else through `operators`."""

    def __init__(self, kernel, operators):
        super().__init__()
        self.kernel, self.operators = kernel, operators

    def construct(self, x, y):
        if x.dtype == ms.float32 and y.dtype == ms.float32:
            return self.kernel(x, y)
        return self.operators(x, y)


def residual_add(operators):
    """The residual stream's addition: `operators` (its strategies), or on CPU the kernel."""
    kernel = cpu_kernel("add", dtype=ms.float32)
    return operators if kernel is None else AddKernel(kernel, operators)
