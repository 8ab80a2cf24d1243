"""What a job will ask of the machine's memory, said before any work: a batch too large is one
line at the start, not the OOM killer halfway through an export.

The model is calibrated on peak resident memory (``/usr/bin/time -f %M``) of bert-tiny and
bert-base (W = 0.44 GB of fp32 weights) on AMD Zen 4, TVM 0.27, torch 2.13:

- the process itself (Python, torch, TVM, transformers): 0.70 GB (bert-tiny trace and build);
- trace and convert: 1.8 W more (1.49 and 1.45 GB); build: 3.6 W more (2.19 to 2.32 GB, from
  1 x 14 to 32 x 512: the compiler's peak does not grow with the shape);
- running it beside its PyTorch reference (verify, bench): 2 W plus the activations below
  (bert-base 8 x 128: 1.86 GB measured, 1.66 estimated; 32 x 512: 3.18 measured, 3.40 estimated).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvmbert.core.errors import InputError

GB = 1e9
PROCESS_BYTES = 0.70 * GB
TRACE_WEIGHTS = 1.8  # copies of the weights torch.export and the Relax import hold at their peak
BUILD_WEIGHTS = 3.6  # ... the TVM build holds (weights bound, relaid out, saved)
RUN_WEIGHTS = 2.0  # the compiled model's and its PyTorch reference's
# Per token, in hidden- and intermediate-sized vectors alive at once in a layer (Q, K, V, context,
# residuals, layer norm; the FFN's two), and per sequence the attention scores and probabilities
# (heads x seq x seq each), as PyTorch's eager attention holds them.
HIDDEN_VECTORS, INTERMEDIATE_VECTORS, SCORE_MATRICES = 12, 2, 2
ELEMENT_BYTES = {"float64": 8}  # every other dtype: traced and referenced in float32


@dataclass(frozen=True)
class ModelSizes:
    weights: int  # parameters, shared ones once
    hidden: int
    intermediate: int
    heads: int
    layers: int
    # The weight matmuls' distinct weights (Q, K, V, output, the FFN's two; ALBERT's layers share
    # one set): what a call reads at least once.
    matmul_weights: int
    # Multiply-adds of a layer's weight matmuls per token (its Linear weights: 4 H^2 + 2 H I in
    # BERT, 4 H^2 + 3 H I with ModernBERT's GeGLU).
    layer_macs: int
    # The keys each layer attends to: None for all of them, else a local window's width.
    attention_keys: tuple[int | None, ...]

    def flops(self, batch: int, seq: int) -> float:
        """One call's floating-point operations (a multiply-add is two) in the encoder's layers:
        per token the weight matmuls, and attention's scores and P V (2 H a key attended to).
        What any engine must compute, however; embeddings, norms and most heads add under 1%,
        a fill-mask head's vocabulary projection (2 H V a token) about a quarter more at
        bert-base's sizes, which this leaves out."""
        keys = sum(seq if window is None else min(window, seq) for window in self.attention_keys)
        return 2.0 * batch * seq * (self.layers * self.layer_macs + 2 * self.hidden * keys)


@dataclass(frozen=True)
class Estimate:
    compile_bytes: float  # the peak of trace, convert and build
    run_bytes: float  # the peak of running the largest shape beside its reference

    @property
    def peak_bytes(self) -> float:
        return max(self.compile_bytes, self.run_bytes)


def estimate(sizes: ModelSizes, shapes: list[tuple[int, int]], dtype: str) -> Estimate:
    """The peak resident memory of compiling and running the model at the largest of ``shapes``
    ((batch, seq_len) pairs)."""
    element = ELEMENT_BYTES.get(dtype, 4)
    weights = sizes.weights * element
    activations = max(batch * seq * ((HIDDEN_VECTORS * sizes.hidden + INTERMEDIATE_VECTORS * sizes.intermediate)
                                     + SCORE_MATRICES * sizes.heads * seq) * element for batch, seq in shapes)
    return Estimate(PROCESS_BYTES + max(TRACE_WEIGHTS, BUILD_WEIGHTS) * weights,
                    PROCESS_BYTES + RUN_WEIGHTS * weights + activations)


def available_bytes() -> float:
    """Memory this process can still take without swapping: what the kernel calls available."""
    import psutil

    return float(psutil.virtual_memory().available)


def check(sizes: ModelSizes, shapes: list[tuple[int, int]], dtype: str, what: str) -> Estimate:
    """The estimate, or an InputError when it is above the memory available now."""
    needed = estimate(sizes, shapes, dtype)
    available = available_bytes()
    if needed.peak_bytes > available:
        batch, seq = max(shapes, key=lambda shape: shape[0] * shape[1])
        part = "compiling it" if needed.compile_bytes >= needed.run_bytes else f"running {batch} x {seq}"
        raise InputError(f"{what} needs about {needed.peak_bytes / GB:.1f} GB ({part}) and this machine has "
                         f"{available / GB:.1f} GB available: use a smaller --batch or --seq-len, or a machine with more memory")
    return needed
