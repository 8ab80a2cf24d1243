"""This machine's floors, measured where bench runs, so that each engine's time reads against what
the machine allows: an engine at 95% of a shape's floor has at most 5% left to win there, whatever
the ratio between engines says.

- The FMA peak: independent chains of vector FMAs held in registers on every thread (no loads),
  built by TVM for the job's target. It is the rate of the arithmetic the weight matmuls are made
  of. Measured first (the best of a few runs), then between the engines' rounds: a shape's floor
  is at its median there, the clock the engines ran at.
- The memory bandwidth: the rows of a buffer summed by every thread, the caches flushed before
  each run: the rate at which a matmul reads weights it cannot keep in cache.

A shape's floor is the larger of its FLOPs at the peak and, where they do not fit in the last
level cache (calls back to back keep weights that do), its weight matmuls' weights read once at
the bandwidth. It is given for fp32 and fp64, the arithmetic the probe runs, and for the engines
that run it: int8 and bf16 run other instructions (``vpmaddubsw``, VNNI, AMX) whose peak this
does not measure, and a packed build skips the padding the shape's FLOPs count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from tvmbert.core import registry
from tvmbert.core.memory import ModelSizes
from tvmbert.deploy.loader import check_cpu

# Accumulators per thread: at least an FMA's latency times the FMA units (4-5 cycles x 2 on the
# x86 cores seen here), and with the multiplier and addend within AVX2's 16 vector registers.
CHAINS = 12
FMA_STEPS = 400_000  # per run and thread: a few milliseconds, far above the thread pool's start
BANDWIDTH_BYTES = 64 * 2**20  # above any core's L2, flushed from every cache level before each run
BANDWIDTH_COLUMNS = 4096
BANDWIDTH_VECTORS = 4  # accumulators a row: one add chain would bind a thread to its latency, not to memory
RUNS = 5
# Timed runs of the probe between rounds, its rate their best: after the engines' rounds the
# first run or two went at half the rate (2 cores of a Zen 4: the probe's two threads started on
# one core, the scheduler spreading them a few ms later), and a shape's floor read twice too low.
PROBE_CALLS = 8
FLOOR_DTYPES = {"float32": 4, "float64": 8}  # the probe's arithmetic, and the weights' bytes


@dataclass(frozen=True)
class Floor:
    fma_gflop_per_s: float
    memory_gb_per_s: float
    cache_bytes: int  # the last level cache's
    dtype: str

    def shape_ms(self, sizes: ModelSizes, batch: int, seq: int) -> tuple[float, str]:
        """A shape's floor in ms and what binds it ("fma" or "memory")."""
        compute_ms = sizes.flops(batch, seq) / self.fma_gflop_per_s / 1e6
        weight_bytes = sizes.matmul_weights * FLOOR_DTYPES[self.dtype]
        memory_ms = weight_bytes / self.memory_gb_per_s / 1e6 if weight_bytes > self.cache_bytes else 0.0
        return max(compute_ms, memory_ms), "fma" if compute_ms >= memory_ms else "memory"


def applies_to(engine: str) -> bool:
    """Whether ``engine`` runs the arithmetic the floor counts: not a quantized peer's, not the
    packed build's (its padding skipped)."""
    return registry.ENGINES[engine].quantized is None and engine != "tvm-packed"


def last_level_cache_bytes(cpu: int = 0) -> int:
    """The largest cache ``cpu`` has, as Linux lists them (0 where it does not)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    sizes = []
    for index in Path(f"/sys/devices/system/cpu/cpu{cpu}/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
    return max(sizes, default=0)


def fma_probe(threads: int, lanes: int, dtype: str, steps: int = FMA_STEPS):
    """TIR: on each of ``threads`` threads, CHAINS vectors updated ``acc = acc * m + c`` ``steps``
    times (LLVM contracts each into one FMA where the target has them), then stored: nothing is
    loaded in the loop."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def probe(operands: T.Buffer((2, lanes), dtype), out: T.Buffer((threads, CHAINS, lanes), dtype)):
        T.func_attr({"tirx.noalias": True})
        for t in T.parallel(threads):
            acc = T.alloc_buffer((CHAINS, lanes), dtype, scope="local")
            for i in T.unroll(CHAINS):
                for x in T.vectorized(lanes):
                    acc[i, x] = operands[1, x] + T.Cast(dtype, i)
            for _ in range(steps):
                for i in T.unroll(CHAINS):
                    for x in T.vectorized(lanes):
                        acc[i, x] = acc[i, x] * operands[0, x] + operands[1, x]
            for i in T.unroll(CHAINS):
                for x in T.vectorized(lanes):
                    out[t, i, x] = acc[i, x]

    return probe


def row_sums(rows: int, columns: int, lanes: int):
    """TIR: ``sums[i, x]`` = the sum over k of ``buffer[i, lanes * k + x]``, rows split over the
    threads, ``lanes`` running sums a row (vectorized: ``lanes`` over the target's vector width
    independent add chains). Its first argument is unread: TVM's cache flush spares the first
    argument."""
    import tvm
    from tvm import te

    first = te.placeholder((lanes,), name="first")
    buffer = te.placeholder((rows, columns), name="buffer")
    k = te.reduce_axis((0, columns // lanes), "k")
    sums = te.compute((rows, lanes), lambda i, x: te.sum(buffer[i, k * lanes + x], axis=k), name="sums")
    schedule = tvm.s_tir.Schedule(te.create_prim_func([first, buffer, sums]))
    i, x, reduction = schedule.get_loops(schedule.get_sblock("sums"))
    schedule.reorder(i, reduction, x)
    schedule.parallel(i)
    schedule.vectorize(x)
    return schedule.mod


class FmaProbe:
    """``fma_probe`` built once and called between the engines' rounds: each call's rate is the
    peak as the engines meet it at that moment (a shared machine's clock moves within minutes: 80
    and 95 GFLOP/s on the same 2 cores within the hour)."""

    def __init__(self, target, threads: int, dtype: str):
        import numpy as np
        import tvm

        from tvmbert.core.targets import vector_lanes

        tvm_target = target.tvm_target()
        lanes = vector_lanes(tvm_target, np.dtype(dtype).itemsize * 8)
        self.library = tvm.compile(fma_probe(threads, lanes, dtype), target=tvm_target).mod
        device = tvm.cpu()
        self.operands = tvm.runtime.tensor(np.full((2, lanes), 0.5, dtype), device)  # acc tends to 1: no overflow, no denormals
        self.out = tvm.runtime.tensor(np.zeros((threads, CHAINS, lanes), dtype), device)
        self.flops = 2.0 * threads * FMA_STEPS * CHAINS * lanes

    def __call__(self) -> float:
        """The best of PROBE_CALLS timed runs, after an untimed one that wakes the thread pool."""
        self.library(self.operands, self.out)
        best = float("inf")
        for _ in range(PROBE_CALLS):
            started = time.perf_counter()
            self.library(self.operands, self.out)
            best = min(best, time.perf_counter() - started)
        return self.flops / best / 1e9


def memory_gb_per_s(target, nbytes: int = BANDWIDTH_BYTES, hot: bool = False) -> float:
    """The best of RUNS runs of ``row_sums`` over ``nbytes`` on the thread pool's threads, the
    caches flushed before each run (``hot``: not flushed)."""
    import numpy as np
    import tvm

    lanes = BANDWIDTH_VECTORS * max(target.fp32_lanes, 4)
    rows = max(1, round(nbytes / (BANDWIDTH_COLUMNS * 4)))
    library = tvm.compile(row_sums(rows, BANDWIDTH_COLUMNS, lanes), target=target.tvm_target()).mod
    device = tvm.cpu()
    arrays = [tvm.runtime.tensor(np.zeros(lanes, "float32"), device),
              tvm.runtime.tensor(np.full((rows, BANDWIDTH_COLUMNS), 1.0, "float32"), device),
              tvm.runtime.tensor(np.zeros((rows, lanes), "float32"), device)]
    flush = {} if hot else {"f_preproc": "cache_flush_cpu_non_first_arg"}
    seconds = min(library.time_evaluator("main", device, number=1, repeat=RUNS, **flush)(*arrays).results)
    return rows * BANDWIDTH_COLUMNS * 4 / seconds / 1e9


def measure(target, threads: int, dtype: str) -> tuple[Floor, FmaProbe] | None:
    """This machine's floor for ``dtype`` on ``threads`` threads (set_threads first), its FMA peak
    the best of RUNS probe runs, and the probe for the rounds; None where the probe does not apply
    (a GPU, a dtype it does not run). The probes are built for ``target``: refused, as the model's
    library would be, where this CPU lacks an instruction set it allows (SIGILL, not an error)."""
    if target.is_gpu or dtype not in FLOOR_DTYPES:
        return None
    check_cpu("bench", target.config)
    probe = FmaProbe(target, threads, dtype)
    peak = max(probe() for _ in range(RUNS))
    return Floor(round(peak, 1), round(memory_gb_per_s(target), 1), last_level_cache_bytes(), dtype), probe
