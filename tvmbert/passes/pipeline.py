"""The one compile pipeline, in phases; adding a graph pass is one entry in PASSES.

1. Graph passes (``PASSES``, in canonical order): the optimize stage runs the default ones and
   those a job's dtype and target add; each pass is a file of this folder.
2. Lowering (``lowering``): training's forward and backward modules take the graph passes that
   apply to them, plus weight transposes folded into their matmuls.
3. Scheduling (``tuning/compile.py``): tuning databases, then default schedules, then the tuned
   kernels' weight layouts lifted into a function the build runs once.
Below the stages: config checks pass names against this table, and training lowers with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tvmbert.core.config import MIXED_PRECISION
from tvmbert.core.errors import InputError


@dataclass(frozen=True)
class PassContext:
    """What a pass's TVM passes may depend on: the job's dtype and resolved target."""

    dtype: str = "float32"
    target: object | None = None  # core.targets.TargetSpec
    fast_math: bool = False
    min_rows: int = 1  # the fewest rows a weight matmul or layer norm runs on our kernels with (kernels/fma.MIN_ROWS)

    @property
    def fp32_kernels(self) -> bool:
        """Our fp32 kernels (FMA matmuls, attention, layer norm): for --dtype float32 on a CPU with
        vector FMA, for int8 there too (only the weight matmuls run in int8), and for bfloat16 on
        AMX, where only the weight matmuls run in bf16."""
        lanes = self.target.fp32_lanes if self.target is not None else 0
        return lanes > 0 and (self.dtype in ("float32", "int8") or self.amx)

    @property
    def amx(self) -> bool:
        return self.dtype == "bfloat16" and self.target is not None and self.target.has_amx_bf16

    @property
    def attention_on_amx(self) -> bool:
        """Attention's two matmuls on AMX-BF16 (scores to about 16 bits, bf16 probabilities and
        values), for int8 and bfloat16 on CPUs with AMX: the fp32 kernel took a quarter of
        bert-base's int8 time at 8 x 128, and left bf16 at 512 tokens no faster than
        torch.compile's bf16; all-MiniLM-L6-v2's accuracy stays int8's and bf16's (docs/precision.md)."""
        return self.dtype in ("int8", "bfloat16") and self.target is not None and self.target.has_amx_bf16

    @property
    def attention_in_int8(self) -> bool:
        """Attention's two matmuls in int8 on ``vpdpbusd`` (Q, K and V per row, the weights of P V
        in 16 bits of their row's largest: ``kernels/attention.vnni_int8_kernel``), for int8 on
        AVX-512 VNNI without AMX, as ONNX Runtime's and NNCF's int8 quantize these matmuls too: the
        fp32 kernel was a sixth of modernbert-base's int8 time at 8 x 128 on Zen 4, and
        all-MiniLM-L6-v2's accuracy stays fp32 attention's (docs/precision.md)."""
        target = self.target
        return (self.dtype == "int8" and target is not None and not self.attention_on_amx and target.fp32_lanes == 16
                and target.int8_lanes == 16 and target.int8_instruction == "vpdpbusd")


@dataclass(frozen=True)
class GraphPass:
    name: str
    make: Callable[[PassContext], list]  # the TVM passes it runs, in order
    added_for: Callable[[PassContext], bool] | None = None  # opt-in: not in the default pipeline; added where this holds
    per_target: bool = False  # what it makes depends on the target beyond whether it is added


def _relax():
    from tvm import relax

    return relax.transform


def _combine_qkv(_context):
    from tvmbert.passes.combine_qkv import combine_parallel_matmuls

    return [combine_parallel_matmuls()]


def _gather_columns(_context):
    from tvmbert.passes.gather_columns import gathered_columns

    return [gathered_columns()]


def _unflatten_bmm(_context):
    from tvmbert.passes.unflatten_bmm import unflatten_batched_matmuls

    return [unflatten_batched_matmuls()]


def _flash_attention(context):
    from tvmbert.passes.flash_attention import flash_attention

    return [flash_attention(context.target.tvm_target(), context.dtype)]


def _flat_epilogues(_context):
    from tvmbert.passes.flat_epilogues import flat_epilogues

    return [flat_epilogues()]


def _mixed_precision(context):
    from tvmbert.passes.mixed_precision import reduced_precision_matmuls

    if context.dtype == "float16":
        return [_relax().ToMixedPrecision(out_dtype="float32")]
    return [reduced_precision_matmuls(context.dtype)]


def _amx_bf16(_context):
    from tvmbert.passes.amx_bf16 import amx_matmuls

    return [amx_matmuls()]


def _layer_norm_fp32(context):
    from tvmbert.passes.layer_norm_fp32 import layer_norm_rewrite

    return [layer_norm_rewrite(context.target.fp32_lanes, context.min_rows)]


def _int8_matmuls(context):
    from tvmbert.passes.int8_matmuls import int8_matmuls, quantizing_norms

    target = context.target
    return [int8_matmuls(target.int8_lanes, target.int8_instruction, target.has_amx_int8), quantizing_norms(target.fp32_lanes)]


def _fma_fp32(context):
    from tvmbert.passes.fma_fp32 import fma_matmuls

    return [fma_matmuls(context.target.fp32_lanes, context.min_rows)]


def _attention_fp32(context):
    from tvmbert.passes.attention_fp32 import attention_rewrite

    # A bf16 build's Q and K are bf16 as a bf16 model's are: its scores one bf16 product (an int8
    # build's three, about 16 bits: docs/precision.md).
    return [attention_rewrite(context.target.fp32_lanes, amx_bf16=context.attention_on_amx,
                              bf16_scores=context.dtype == "bfloat16", int8=context.attention_in_int8)]


def _fast_math(_context):
    from tvmbert.passes.fast_math import fast_math

    return fast_math()


def _legalize(_context):
    from tvmbert.passes.legalize import legalizations

    t = _relax()
    return [t.LegalizeOps(legalizations()), t.AnnotateTIROpPattern(), t.FoldConstant()]


# In their canonical order: an opt-in pass is added before the first listed pass that follows it here.
PASSES = (
    GraphPass("fold-constants", lambda c: [_relax().FoldConstant()]),
    GraphPass("cse", lambda c: [_relax().EliminateCommonSubexpr()]),
    # A matmul only gathered from at constant columns computes those alone (DeBERTa's position
    # scores: at 128 tokens 255 of 512 relative positions).
    GraphPass("gather-columns", _gather_columns),
    # Q, K and V projections (same input) become one matmul + split; biases too.
    GraphPass("combine-qkv", _combine_qkv),
    # Attention's two matmuls on 4-D tensors, where the exporter flattened them to 3-D between
    # reshapes: the scale and the mask then fuse into the Q K^T kernel.
    GraphPass("unflatten-bmm", _unflatten_bmm),
    # Added for GPU targets: each layer's attention (Q K^T, scale, mask, softmax, P V and the head
    # transposes around them) becomes one call of a flash-attention kernel (kernels/flash_attention.py),
    # before mixed-precision: the kernel reads the fp32 projections and casts as it loads.
    GraphPass("flash-attention", _flash_attention, added_for=lambda c: c.target is not None and c.target.is_gpu,
              per_target=True),
    # Added for --dtype float16/bfloat16: matmuls in reduced precision accumulating in fp32;
    # bind-params then stores those weights in it (half the bytes to stream per inference).
    GraphPass("mixed-precision", _mixed_precision, added_for=lambda c: c.dtype in MIXED_PRECISION),
    # Added for GPU targets: bias + GELU, bias + residual and the casts after layer norms run on
    # the matmuls' [rows, columns] results, not on 3-D views of them, so FuseOps folds them into
    # the matmuls' and layer norms' kernels; fp16 -> fp32 -> fp16 round trips go.
    GraphPass("flat-epilogues", _flat_epilogues, added_for=lambda c: c.target is not None and c.target.is_gpu),
    # Added for --dtype bfloat16 on CPUs with AMX-BF16: weight matmuls call our AMX kernel
    # (kernels/amx.py), their weights laid out in its tiles by bind-params.
    GraphPass("amx-bf16", _amx_bf16, added_for=lambda c: c.amx),
    # Added with fma-fp32 and with amx-bf16 (whose graph keeps layer norm in fp32): layer norms
    # over a multiple of the vector lanes call our kernel (kernels/layer_norm.py: a row at a
    # time, two passes in L1), with the residual add before them: before fma-fp32, which would
    # otherwise fold that add into its matmul (amx-bf16, earlier, keeps the adds it folded).
    GraphPass("layer-norm-fp32", _layer_norm_fp32, added_for=lambda c: c.fp32_kernels, per_target=True),
    # Added for --dtype int8 on CPUs with AVX-512 or AVX2: weight matmuls (with their bias) call
    # our int8 kernel (kernels/int8.py; on AMX-INT8, kernels/amx.py) on their rows quantized as
    # each call finds them (by the layer norm before them, where only they read it), their weights
    # quantized per output channel and laid out in its panels by bind-params.
    GraphPass("int8-matmuls", _int8_matmuls, added_for=lambda c: c.fp32_kernels and c.dtype == "int8", per_target=True),
    # Added for --dtype float32 (and int8, for the matmuls int8-matmuls leaves) on CPUs with
    # AVX-512 or AVX2: weight matmuls (with their bias) with enough rows to be compute-bound call
    # our FMA micro-kernel (kernels/fma.py), their weights laid out in its panels by bind-params.
    GraphPass("fma-fp32", _fma_fp32, added_for=lambda c: c.fp32_kernels and c.dtype in ("float32", "int8"), per_target=True),
    # Added with fma-fp32 and with amx-bf16 (whose graph keeps attention in fp32): each layer's
    # attention (Q K^T, scale, mask, softmax, P V and the head transposes around them) becomes
    # one call of our kernel (kernels/attention.py; for int8 and bf16 on AMX, its matmuls on AMX-BF16,
    # for int8 on AVX-512 VNNI, in int8).
    GraphPass("attention-fp32", _attention_fp32, added_for=lambda c: c.fp32_kernels, per_target=True),
    # Weight-only computations (transposed weights, the position-embedding slice) move into
    # main_transform_params, which the build runs once: folded like bound constants, while
    # the weights stay in a separate file instead of inside the library.
    GraphPass("bind-params", lambda c: [_relax().LiftTransformParams()]),
    GraphPass("dce", lambda c: [_relax().DeadCodeElimination()]),
    # Off by default (--fast-math): GELU as tanh, fast exp/erf/tanh/softmax.
    GraphPass("fast-math", _fast_math, added_for=lambda c: c.fast_math),
    GraphPass("legalize", _legalize),
    GraphPass("fuse", lambda c: [_relax().FuseOps(), _relax().FuseTIR()]),
)
PASS_NAMES = tuple(p.name for p in PASSES)
DEFAULT_PASSES = tuple(p.name for p in PASSES if p.added_for is None)


def check_pass_names(names, where: str = "options") -> None:
    unknown = [name for name in names if name not in PASS_NAMES]
    if unknown:
        raise InputError(f"{where}: unknown pass {', '.join(repr(n) for n in unknown)} (known: {', '.join(PASS_NAMES)})")


def selected(chosen: tuple[str, ...] | None, context: PassContext, disable: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The pipeline a job runs: the chosen passes (default: every default one), plus those its
    dtype and target add, each in its canonical place, less the disabled."""
    check_pass_names(disable, "--disable")
    passes = chosen if chosen is not None else DEFAULT_PASSES
    for graph_pass in PASSES:
        name = graph_pass.name
        if graph_pass.added_for is not None and graph_pass.added_for(context) and name not in passes:
            # In its canonical place: before the first pass that comes after it in PASS_NAMES.
            rank = PASS_NAMES.index(name)
            at = next((i for i, other in enumerate(passes) if PASS_NAMES.index(other) > rank), len(passes))
            passes = (*passes[:at], name, *passes[at:])
    return tuple(name for name in passes if name not in disable)


def pass_list(names, context: PassContext | None = None) -> list:
    """The TVM passes behind ``names``, in order."""
    table = {p.name: p for p in PASSES}
    return [tvm_pass for name in names for tvm_pass in table[name].make(context or PassContext())]


def per_target(names) -> bool:
    """Whether the pipeline's result depends on the target beyond which passes it names."""
    return any(p.per_target for p in PASSES if p.name in names)


def lowering(entries: tuple[str, ...]):
    """Phase 2, for training's modules: the graph passes that apply to a forward and its backward,
    plus weight transposes folded into their matmuls: the weights arrive as PyTorch keeps them
    ([out, in]) on every call, and a separate transpose kernel would copy them all each time."""
    import tvm

    t = _relax()
    dce = t.DeadCodeElimination(list(entries))
    return tvm.transform.Sequential([
        *pass_list(("fold-constants", "cse")), dce, t.FuseTransposeMatmul(), *pass_list(("legalize", "fuse")), dce,
    ])
