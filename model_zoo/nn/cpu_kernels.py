"""Fused CPU kernels as MindSpore AOT custom operators: the dense layers and attention,
layer norm, GELU, cross-entropy, bias and residual additions, dropout, the gradient norm,
the whole AdamW update and the few-rows matmul of decoding.

On CPU, MindSpore's LayerNormGrad, GeLU and SoftmaxCrossEntropyWithLogits kernels take 5-20x
longer than one pass over memory would (a layer norm's forward and backward on 1024 x 256
floats: 4.3 ms against 0.7 ms here; see benchmarks/README.md), its MatMul stays below the
machine's GEMM peak at a transformer's shapes, and attention is a dozen operators with
slices and transposes. `cpu_kernels.cc` does each in one vectorised pass per direction,
split over the cores by helper threads of its own; the dense layers and attention call the
oneDNN library MindSpore ships (`mindspore/lib/libdnnl.so.3`) for their products. It is
compiled with the machine's C++ compiler on first use into a cache folder
(`$MODEL_ZOO_KERNEL_CACHE`, default `~/.cache/model_zoo/kernels`), keyed by the source, the
flags and the CPU, so each machine builds it once.

Without a compiler the layers fall back to MindSpore's own operators (slower, same math);
without MindSpore's oneDNN, the dense layers and attention do. Ascend runs and the plan
check never use these: they take MindSpore's fused kernels, which carry the sharding
strategies (`backend.kernels_for`).
"""

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mindspore as ms
from mindspore import nn, ops

SOURCE = Path(__file__).with_name("cpu_kernels.cc")
# -z nodelete: the kernels' helper threads live in the library, which must stay loaded;
# 512-bit vectors for the few-rows matmul's 16-float tiles (an x86 option only);
# -fno-math-errno lets the optimizer's square roots vectorise
FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fno-math-errno", "-fopenmp-simd",
         "-shared", "-fPIC",
         "-std=c++17", "-pthread", "-Wl,-z,nodelete"] + \
    (["-mprefer-vector-width=512"] if platform.machine() in ("x86_64", "AMD64") else [])


# The oneDNN interface cpu_kernels.cc declares: 3.x's thread-pool interop (sgemm and
# threadpool_iface), in a build for a caller's thread pool (dnnl_version_t.cpu_runtime
# DNNL_RUNTIME_THREADPOOL). Tested with 3.10.1, which MindSpore 2.10 ships.
ONEDNN_MAJOR = 3
ONEDNN_THREADPOOL_RUNTIME = 8


class _OnednnVersion(ctypes.Structure):   # dnnl_version_t (oneapi/dnnl/dnnl_types.h)
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint),
                ("gpu_runtime", ctypes.c_uint)]


def onednn_version(path) -> tuple:
    """(major, minor, patch, cpu runtime) of the oneDNN library at `path` (`dnnl_version`)."""
    read = ctypes.CDLL(str(path)).dnnl_version
    read.restype = ctypes.POINTER(_OnednnVersion)
    found = read().contents
    return found.major, found.minor, found.patch, found.cpu_runtime


def _onednn_link_flags() -> tuple:
    """(flags that link the oneDNN MindSpore ships, `mindspore/lib/libdnnl.so.3`, for the
    dense kernels; why they do not): no flags when this MindSpore has no such file, or its
    version or threading runtime is not the interface the kernels declare."""
    path = Path(ms.__file__).parent / "lib" / "libdnnl.so.3"
    if not path.is_file():
        return [], ""
    try:
        major, minor, patch, runtime = onednn_version(path)
    except (OSError, AttributeError) as error:
        return [], f"cannot read the version of {path} ({error})"
    if major != ONEDNN_MAJOR or runtime != ONEDNN_THREADPOOL_RUNTIME:
        return [], (f"MindSpore's oneDNN is {major}.{minor}.{patch} (threading runtime "
                    f"{runtime}), not {ONEDNN_MAJOR}.x built for a caller's thread pool "
                    f"(runtime {ONEDNN_THREADPOOL_RUNTIME}), which the kernels declare")
    # the version is a flag, so a MindSpore with another oneDNN builds the kernels anew
    return ["-DMODEL_ZOO_DNNL", f"-DMODEL_ZOO_DNNL_VERSION={major}.{minor}.{patch}",
            f"-L{path.parent}", "-l:libdnnl.so.3", f"-Wl,-rpath,{path.parent}"], ""


LINK_FLAGS, ONEDNN_UNUSABLE = _onednn_link_flags()


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "model_zoo" / "kernels"
    return Path(os.environ.get("MODEL_ZOO_KERNEL_CACHE", default))


def _compiler() -> str:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or ""


def _target(compiler: str, link_flags: list) -> Path:
    """Where the kernels built by `compiler` with `link_flags` live in the cache."""
    return cache_dir() / _build_key(compiler, tuple(link_flags)) / "cpu_kernels.so"


@functools.lru_cache(maxsize=None)
def _build_key(compiler: str, link_flags: tuple) -> str:
    """The cache folder's name for a build: a digest of the source, the compiler, the flags
    and this CPU's features (read once a process: every layer built asks `has_dense`)."""
    # -march=native: the key includes this CPU's features, so a cache folder shared by
    # machines of different kinds never hands one of them code it cannot run
    key = SOURCE.read_bytes() + " ".join([compiler, *FLAGS, *link_flags]).encode() + \
        _cpu_features()
    return hashlib.sha1(key).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def library() -> str:
    """Path of the compiled kernels, building them if needed (with MindSpore's oneDNN when
    it links, else without it); "" when they cannot be built."""
    compiler = _compiler()
    if not compiler:
        return _unavailable("no C++ compiler (g++) found")
    if ONEDNN_UNUSABLE:
        print(f"[model_zoo] {ONEDNN_UNUSABLE}; the dense layers and attention use "
              f"MindSpore's operators", file=sys.stderr, flush=True)
    if LINK_FLAGS:
        path, error, compiler_failed = _build(compiler, LINK_FLAGS)
        if path or not compiler_failed:
            return path or _unavailable(error)
        print(f"[model_zoo] cannot link MindSpore's oneDNN ({error}); the dense layers and "
              f"attention use MindSpore's operators", file=sys.stderr, flush=True)
    path, error, _ = _build(compiler, [])
    return path or _unavailable(error)


def _build(compiler: str, link_flags: list) -> tuple:
    """(path, "", False) once the kernels built with `link_flags` are in the cache, else
    ("", why not, whether the compiler was what failed)."""
    target = _target(compiler, link_flags)
    whitelist = os.environ.get("MS_CUSTOM_AOT_WHITE_LIST")
    if whitelist and not str(target.resolve()).startswith(os.path.realpath(whitelist)):
        return "", (f"MS_CUSTOM_AOT_WHITE_LIST={whitelist} excludes {target.parent}; "
                    f"set MODEL_ZOO_KERNEL_CACHE to a folder inside it"), False
    if target.exists():
        return str(target), "", False
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # build beside the target and rename: ranks starting together never load half a file
        with tempfile.TemporaryDirectory(dir=target.parent) as staging:
            staged = Path(staging, target.name)
            result = subprocess.run([compiler, *FLAGS, "-o", str(staged), str(SOURCE),
                                     *link_flags], capture_output=True, text=True)
            if result.returncode != 0:
                return "", f"{compiler} failed: {result.stderr.strip()[-500:]}", True
            os.replace(staged, target)
    except OSError as error:
        return "", f"cannot build in {target.parent}: {error}", False
    return str(target), "", False


def _cpu_features() -> bytes:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            return next((line for line in handle if line.startswith("flags")), "").encode()
    except OSError:
        return platform.machine().encode()


def _unavailable(reason: str) -> str:
    print(f"[model_zoo] fused CPU kernels unavailable ({reason}); using MindSpore's CPU "
          f"operators, which are slower", file=sys.stderr, flush=True)
    return ""


def available() -> bool:
    return bool(library())


def has_dense() -> bool:
    """Whether the dense and attention kernels are built: the kernels are, with oneDNN."""
    return available() and bool(LINK_FLAGS) and \
        library() == str(_target(_compiler(), LINK_FLAGS))


def _custom(name: str, out_shape, out_dtype, bprop=None):
    return ops.Custom(f"{library()}:{name}", out_shape=out_shape, out_dtype=out_dtype,
                      func_type="aot", bprop=bprop)


def _rows(shape):
    rows = 1
    for size in shape[:-1]:
        rows *= size
    return [rows]


def layer_norm():
    """Custom op (x, gamma, beta, eps) -> (y, mean, rstd) over x's last axis, float32, with
    its backward pass; eps is a float32 scalar tensor."""
    backward = _custom("LayerNormBackward", lambda dy, x, gamma, mean, rstd: (x, gamma, gamma),
                       lambda dy, x, gamma, mean, rstd: (x, gamma, gamma))

    def bprop(x, gamma, beta, eps, out, dout):
        dx, dgamma, dbeta = backward(dout[0], x, gamma, out[1], out[2])
        return dx, dgamma, dbeta, ops.zeros_like(eps)

    return _custom("LayerNormForward", lambda x, gamma, beta, eps: (x, _rows(x), _rows(x)),
                   lambda x, gamma, beta, eps: (x, x, x), bprop)


def rms_norm():
    """Custom op (x, weight, eps) -> (y, rstd) over x's last axis, float32, with its backward
    pass; eps is a float32 scalar tensor."""
    backward = _custom("RmsNormBackward", lambda dy, x, weight, rstd: (x, weight),
                       lambda dy, x, weight, rstd: (x, weight))

    def bprop(x, weight, eps, out, dout):
        dx, dweight = backward(dout[0], x, weight, out[1])
        return dx, dweight, ops.zeros_like(eps)

    return _custom("RmsNormForward", lambda x, weight, eps: (x, _rows(x)),
                   lambda x, weight, eps: (x, x), bprop)


def rotary(parts: int = 1):
    """Custom op (x (..., seq, W), cos (seq, D), sin (seq, D)) -> x rotated (rotary position
    embedding, the half-split layout), float32, with its backward pass (the tables are
    constants: no gradient). Each row of x holds W / (parts D) heads of `parts` D features:
    parts 1 rotates query or key heads ((B, H, L, D) or (B, L, H D)); parts 2 rotates the
    keys of a fused key-value projection (B, L, Hkv 2 D) and passes the values through."""
    name = {1: "Rotary", 2: "RotaryKeys"}[parts]
    backward = _custom(f"{name}Backward", lambda dy, cos, sin: dy, lambda dy, cos, sin: dy)

    def bprop(x, cos, sin, out, dout):
        return backward(dout, cos, sin), ops.zeros_like(cos), ops.zeros_like(sin)

    return _custom(f"{name}Forward", lambda x, cos, sin: x, lambda x, cos, sin: x, bprop)


def swiglu():
    """Custom op y (..., 2F), gate and up interleaved ([g_0, u_0, g_1, u_1, ...]) -> silu(g) u
    (..., F), float32, with its backward pass."""
    backward = _custom("SwigluBackward", lambda dh, y: y, lambda dh, y: y)

    def bprop(y, out, dout):
        return (backward(dout, y),)

    return _custom("SwigluForward", lambda y: y[:-1] + [y[-1] // 2], lambda y: y, bprop)


def gelu(exact: bool):
    """Custom op x -> GELU(x), float32, with its backward pass: the erf form when `exact`,
    else the tanh approximation."""
    name = "GeluErf" if exact else "GeluTanh"
    backward = _custom(f"{name}Backward", lambda dy, x: x, lambda dy, x: x)

    def bprop(x, out, dout):
        return (backward(dout, x),)

    return _custom(f"{name}Forward", lambda x: x, lambda x: x, bprop)


class GELU(nn.Cell):
    """GELU computed in float32 by the fused kernel: the erf form (BERT's) when `exact`, else
    the tanh approximation (`ops.GeLU`'s, GPT-2's).

    Inputs:
        x: a tensor of any shape.
    Outputs:
        a tensor of x's shape and dtype.
    """

    def __init__(self, exact: bool):
        super().__init__()
        self.kernel = gelu(exact)

    def construct(self, x):
        return ops.cast(self.kernel(ops.cast(x, ms.float32)), x.dtype)


def cross_entropy():
    """Custom op (logits (N, V), labels int32 (N,), on, off (float32 scalars)) -> (loss (N,),
    log-sum-exp (N,)): softmax cross-entropy against `on` at the label and `off` elsewhere,
    float32, with its backward pass. A label outside [0, V) makes the op raise."""
    backward = _custom("CrossEntropyBackward",
                       lambda dloss, logits, labels, lse, on, off: logits,
                       lambda dloss, logits, labels, lse, on, off: logits)

    def bprop(logits, labels, on, off, out, dout):
        dlogits = backward(dout[0], logits, labels, out[1], on, off)
        return dlogits, ops.zeros_like(labels), ops.zeros_like(on), ops.zeros_like(off)

    return _custom("CrossEntropyForward",
                   lambda logits, labels, on, off: (labels, labels),
                   lambda logits, labels, on, off: (logits, logits), bprop)


def log_softmax_top_k(k: int):
    """Custom op logits (N, V) float32 -> (log-probabilities (N, k), ids int32 (N, k)) of
    each row's k most likely classes, best first: LogSoftmax and TopK of a search step in
    one pass (MindSpore's CPU TopK alone takes about 10 ms on 128 x 8000). No backward."""
    return _custom("LogSoftmaxTopK", lambda logits: ([logits[0], k], [logits[0], k]),
                   lambda logits: (logits, ms.int32))


def reorder_cache():
    """Custom op (cache (R, H, L, D), parents int32 (R,), write_index int32 (R, H, 1, 3),
    new (R, H, 1, D)) -> cache (R, H, L, D), float32: a beam search step's key or value
    cache, rows taken from their parents up to the step's position, the new entry at it,
    zeros after it, in one pass. No backward."""
    return _custom("ReorderCache", lambda cache, parents, index, new: cache,
                   lambda cache, parents, index, new: cache)


def decode_attention():
    """Custom op (qkv (B, 1, 3 H D), cache_key, cache_value (B, H, L, D), write_index int32
    (B, H, 1, 3)) -> context (B, 1, H D), float32: a decoding step's self attention in one
    kernel, its key and value written into the caches in place at the position of
    `write_index` (`cache.cache_index`), the query attending over the positions up to
    it. Marked as writing memory (`side_effect_mem`), as `adamw_update` is. No backward."""
    attend = _custom("DecodeAttention",
                     lambda qkv, key, value, index: [qkv[0], 1, qkv[2] // 3],
                     lambda qkv, key, value, index: qkv)
    attend.add_prim_attr("side_effect_mem", True)
    return attend


def decode_block(half: str):
    """Custom op of one half of a pre-norm decoder block at a decoding step's few rows
    (B <= SKINNY_ROWS), x (B, 1, W) -> x + f(norm(x)) (B, 1, W), float32, in one launch where
    MindSpore's executor runs five to eight. `half` and its inputs after x:
        "attention": gamma, beta, eps (LayerNorm), w_qkv, b_qkv (laid out head by head),
            w_out, b_out, cache_key, cache_value (B, H, L, D), write_index int32 (B, H, 1, 3);
        "grouped_attention": weight, eps (RMSNorm), w_q[, b_q], w_kv[, b_kv] (laid out kv
            head by kv head), w_out, cos, sin (1, D) (the position's rotary rows), cache_key,
            cache_value (B, G, L, D), write_index int32 (B, G, 1, 3);
        "feed_forward": gamma, beta, eps (LayerNorm), w_fc, b_fc, w_proj, b_proj (GELU, tanh
            form);
        "gated_feed_forward": weight, eps (RMSNorm), w_gate_up (interleaved), w_down.
    The attention halves write the newest keys and values into the caches in place
    (`side_effect_mem`, as `decode_attention`). No backward."""
    name = {"attention": "DecodeAttentionBlock", "grouped_attention": "DecodeGroupedAttentionBlock",
            "feed_forward": "DecodeFeedForwardBlock",
            "gated_feed_forward": "DecodeGatedFeedForwardBlock"}[half]
    block = _custom(name, lambda x, *rest: x, lambda x, *rest: x)
    if half.endswith("attention"):
        block.add_prim_attr("side_effect_mem", True)
    return block


def bias_add():
    """Custom op (x (..., C), bias (C,)) -> x + bias, float32, with its backward pass (the
    input's gradient passes through; the bias's is the column sum)."""
    column_sum = _custom("ColumnSum", lambda dy: dy[-1:], lambda dy: dy)

    def bprop(x, bias, out, dout):
        return dout, column_sum(dout)

    return _custom("BiasAddForward", lambda x, bias: x, lambda x, bias: x, bprop)


def add():
    """Custom op (x, y) -> x + y for two float32 tensors of one shape, with its backward pass
    (both gradients are the output's): MindSpore's CPU Add takes about 4 times as long
    (1024 x 256 floats: 105 against 25 us)."""
    def bprop(x, y, out, dout):
        return dout, dout

    return _custom("AddForward", lambda x, y: x, lambda x, y: x, bprop)


@functools.lru_cache(maxsize=None)
def keyed_dropout():
    """Custom op (x float32, key int32 (4,), keep float32 (1,)) -> x * mask / keep, where the
    mask keeps each element with probability `keep` as a function of the key and the
    element's index alone; the backward pass regenerates the mask from the key."""
    def bprop(x, key, keep, out, dout):
        return keyed(dout, key, keep), ops.zeros_like(key), ops.zeros_like(keep)

    keyed = _custom("KeyedDropout", lambda x, key, keep: x, lambda x, key, keep: x)
    return _custom("KeyedDropout", lambda x, key, keep: x, lambda x, key, keep: x, bprop)


SKINNY_ROWS = 16   # up to this many rows, a matmul reads its weight once (`skinny_matmul`)


def skinny_matmul(with_bias: bool):
    """Custom op (x (M, K), w (N, K)[, bias (N,)]) -> x w^T (+ bias) (M, N), float32, for
    few rows (M <= SKINNY_ROWS, e.g. a decoding step): one pass over w split over the cores
    (the decoding blocks' products too).
    Its backward pass is MindSpore's MatMul."""
    def bprop(x, w, out, dout):
        return ops.matmul(dout, w), ops.matmul(dout.T, x)

    def bprop_with_bias(x, w, bias, out, dout):
        return ops.matmul(dout, w), ops.matmul(dout.T, x), dout.sum(axis=0)

    # two names: MindSpore keeps one backward graph per custom operator's function
    return _custom("SkinnyMatMulBias" if with_bias else "SkinnyMatMul",
                   lambda x, w, *bias: [x[0], w[0]], lambda x, w, *bias: x,
                   bprop_with_bias if with_bias else bprop)


def dense(with_bias: bool):
    """Custom op (x (M, K), w (N, K)[, bias (N,)]) -> x w^T (+ bias) (M, N), float32, on
    oneDNN's sgemm with the work split over the cores; its backward pass computes dx, dw
    (and the bias's gradient) in one launch. Needs `has_dense()`."""
    if with_bias:
        backward = _custom("DenseBiasBackward", lambda dy, x, w: (x, w, dy[-1:]),
                           lambda dy, x, w: (x, w, x))

        def bprop_with_bias(x, w, bias, out, dout):
            return backward(dout, x, w)

        return _custom("DenseBiasForward", lambda x, w, bias: [x[0], w[0]],
                       lambda x, w, bias: x, bprop_with_bias)

    backward = _custom("DenseBackward", lambda dy, x, w: (x, w), lambda dy, x, w: (x, w))

    def bprop(x, w, out, dout):
        return backward(dout, x, w)

    return _custom("DenseForward", lambda x, w: [x[0], w[0]], lambda x, w: x, bprop)


def moe_experts():
    """Custom op (x (T, H), chosen (T, k) int32, weights (T, k), gate (E, H, F), up (E, H, F),
    down (E, F, H)) -> (y (T, H), and two outputs its backward pass reads), float32: each
    token's k chosen SwiGLU experts, weighted and summed, each expert's products on oneDNN's
    sgemm over only the rows routed to it (dropless). Needs `has_dense()`."""
    backward = _custom(
        "MoeExpertsBackward",
        lambda dy, x, chosen, weights, gate, up, down, products, outputs:
            (x, weights, gate, up, down),
        lambda dy, x, chosen, weights, gate, up, down, products, outputs:
            (x, x, x, x, x))

    def bprop(x, chosen, weights, gate, up, down, out, dout):
        dx, dweights, dgate, dup, ddown = backward(dout[0], x, chosen, weights, gate, up, down,
                                                   out[1], out[2])
        return dx, ops.zeros_like(chosen), dweights, dgate, dup, ddown

    def shapes(x, chosen, weights, gate, up, down):
        rows = chosen[0] * chosen[1]
        return x, [rows, 2 * gate[2]], [rows, x[1]]

    return _custom("MoeExpertsForward", shapes,
                   lambda x, chosen, weights, gate, up, down: (x, x, x), bprop)


def self_attention(num_heads: int):
    """Custom op (qkv, bias, causal, key, keep) -> (context, probs), float32: self attention
    in one kernel per direction (`cpu_kernels.cc`), which reads q, k and v where the fused
    projection left them and writes the context with the heads merged.

    Inputs: qkv (B, L, 3 H D) laid out head by head (`attention.fuse_head_projections`);
    bias (B, L) added to each key's scores (padding); causal int32 (1,), non-zero to mask
    later keys; key int32 (4,) and keep float32 (1,): the keyed dropout of the
    probabilities (`keyed_dropout`'s masks on the (B, H, L, L) tensor; keep 1 for none).
    Outputs: context (B, L, H D); probs (B, H, L, L), before dropout, for the backward pass.
    Needs `has_dense()`."""
    backward = _custom("SelfAttentionBackward",
                       lambda dcontext, qkv, probs, causal, key, keep: qkv,
                       lambda dcontext, qkv, probs, causal, key, keep: qkv)

    def bprop(qkv, bias, causal, key, keep, out, dout):
        return (backward(dout[0], qkv, out[1], causal, key, keep), ops.zeros_like(bias),
                ops.zeros_like(causal), ops.zeros_like(key), ops.zeros_like(keep))

    def shapes(qkv, bias, causal, key, keep):
        batch, seq, width = qkv
        return [batch, seq, width // 3], [batch, num_heads, seq, seq]

    return _custom("SelfAttentionForward", shapes,
                   lambda qkv, bias, causal, key, keep: (qkv, qkv), bprop)


def kv_attention(num_heads: int):
    """Custom op (q, kv, bias, causal, key, keep) -> (context, probs), float32:
    `self_attention`'s kernel for a query projection over a separate fused key-value
    projection: cross attention (causal 0), or grouped-query self attention (causal 1, kv_heads
    dividing num_heads, each key/value head read by num_heads / kv_heads query heads in a row,
    without repeating it). Inputs: q (B, Lq, H D); kv (B, Lk, 2 Hkv D) laid out head by head
    (`fuse_head_projections`); bias (B, Lk); causal int32 (1,); key, keep as for
    `self_attention`. Outputs: context (B, Lq, H D); probs (B, H, Lq, Lk)."""
    backward = _custom("KvAttentionBackward",
                       lambda dcontext, q, kv, probs, causal, key, keep: (q, kv),
                       lambda dcontext, q, kv, probs, causal, key, keep: (q, kv))

    def bprop(q, kv, bias, causal, key, keep, out, dout):
        dq, dkv = backward(dout[0], q, kv, out[1], causal, key, keep)
        return (dq, dkv, ops.zeros_like(bias), ops.zeros_like(causal), ops.zeros_like(key),
                ops.zeros_like(keep))

    def shapes(q, kv, bias, causal, key, keep):
        return list(q), [q[0], num_heads, q[1], kv[1]]

    return _custom("KvAttentionForward", shapes,
                   lambda q, kv, bias, causal, key, keep: (q, q), bprop)


def adamw_update():
    """Custom op (lr (1,), factor (1,), apply (1,), constants (3,) = beta1, beta2, eps, decays
    (T,), *params, *first moments, *second moments, *grads) -> placeholder (1,), float32: one
    AdamW step (`nn.AdamWeightDecay`'s, no bias correction) over all T parameters, the
    gradients multiplied by `factor` first; nothing when `apply` is 0 (a step whose gradients
    are not finite). It writes the parameters and moments in place. It is
    marked as writing memory (`side_effect_mem`), which keeps it in the graph's chain of
    side effects; its order after the backward pass comes from the gradients it takes.
    Unlike MindSpore's own optimizer operators it cannot declare which inputs it writes:
    `tests/test_train.py` checks that the writes land."""
    update = _custom("AdamWUpdate", lambda *shapes: [1], lambda *dtypes: dtypes[0])
    update.add_prim_attr("side_effect_mem", True)
    return update


def squared_norm():
    """Custom op (*tensors) -> (1,): the sum of the squares of all their elements, float32
    (the global gradient norm's square, in one pass instead of two operators per tensor)."""
    return _custom("SquaredNorm", lambda *shapes: [1], lambda *dtypes: dtypes[0])

