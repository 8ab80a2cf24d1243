"""Our hand-written TIR kernels, one file each (the kernel and what it needs to be built, no graph
rewriting: the pass that calls each is in ``passes/``). May import core, deploy, frontend and ir.

KERNELS is the table build reads: adding a kernel is its file here, its pass in ``passes/`` with
an entry in ``passes/pipeline.PASSES``, and an entry below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tvmbert.kernels import amx, attention, flash_attention, fma, int8, layer_norm


@dataclass(frozen=True)
class Kernel:
    name: str  # build's metadata lists the kernels of a library as "<name>_kernels"
    attribute: str  # the PrimFunc attribute marking it (tuning and the default schedules leave it alone)
    graph_pass: str  # the pass that calls it
    instructions_in: Callable[[object], dict[str, int]] | None = None  # (executable) -> its key instructions, counted


KERNELS = (
    # and int8-matmuls' on AMX-INT8 (listed as int8 too), and attention-fp32's on AMX-BF16 (listed as attention too)
    Kernel("amx", amx.KERNEL_ATTR, "amx-bf16", amx.instructions_in),
    Kernel("int8", int8.KERNEL_ATTR, "int8-matmuls", int8.instructions_in),
    Kernel("int8_quantize", int8.QUANTIZE_ATTR, "int8-matmuls"),
    Kernel("fma", fma.KERNEL_ATTR, "fma-fp32"),
    Kernel("attention", attention.KERNEL_ATTR, "attention-fp32"),
    Kernel("layer_norm", layer_norm.KERNEL_ATTR, "layer-norm-fp32"),
    Kernel("flash_attention", flash_attention.KERNEL_ATTR, "flash-attention"),
)
