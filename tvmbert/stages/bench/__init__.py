"""Stage 7: latency of the TVM build against the engines a user could pick instead, measured fairly.

Same weights, same inputs, same thread count for every engine; outputs checked against PyTorch
before timing (an engine beyond the bound is timed, flagged and left out of the ratios; one that
fails to run is reported, not timed); warm-up; engines interleaved round by round so that
machine drift hits all of them alike; repeats until both a minimum count and a minimum time;
medians and percentiles. Sweeps over batch, sequence length and padding.

engines: the engines (registry.ENGINES names them), set up and checked; timing: the timed rounds
and their statistics; floor: this machine's FMA peak and memory bandwidth, what each shape's
time reads against; report: CSV, plot and Markdown; inference: the sweep; train: encoder layer
0 forward + backward.
"""

from tvmbert.stages.bench.engines import ENGINES
from tvmbert.stages.bench.inference import bench
from tvmbert.stages.bench.report import plot, to_csv, to_markdown
from tvmbert.stages.bench.train import bench_training

__all__ = ["ENGINES", "bench", "bench_training", "plot", "to_csv", "to_markdown"]
