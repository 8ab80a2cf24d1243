"""An exported package (`tvmbert export`), loaded for serving with NumPy and TVM alone.

No torch and no transformers: this module imports NumPy, TVM inside the functions that need it,
``tokenizers`` only for text, and of tvmbert only ``core`` and ``deploy`` modules that import
nothing more. A call of any batch size and any length up to the largest bucket is planned over
the package's static-shape builds ("buckets"): rows sorted by length, grouped so that the summed
cost of the buckets run (each bucket's latency measured at export) is least, padded (or packed,
for a packed bucket: packing.py), run, and trimmed back.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from tvmbert.core import artifacts, targets
from tvmbert.core.errors import InputError, PackageError
from tvmbert.core.families import TASKS
from tvmbert.deploy import packing
from tvmbert.deploy.inputs import MASK_INPUT, as_integers, check_range, is_torch
from tvmbert.deploy.loader import amx_note, load_library
from tvmbert.deploy.weights import from_bits

MANIFEST_FILE = "manifest.json"
# The manifest's own checksum (it holds every other file's): a manifest edited or damaged after
# export (a bucket's shape, a library's name) is refused rather than misread. Packages written
# before it have none, and load without.
MANIFEST_CHECKSUM_FILE = "manifest.sha256"
FORMAT = 1  # bump when the package layout changes meaning
PACKED_FORMAT = 2  # a package with packed buckets: loaders of format 1 would run them as padded ones
WINDOWING_KEPT = 4  # tokenizers kept for question answering's windows, one per stride
VARIANTS_FORMAT = 3  # a fleet package: a build per CPU, the loader picks one ("variants")
FORMATS = (FORMAT, PACKED_FORMAT, VARIANTS_FORMAT)
TRUNCATION_DIRECTIONS = ("right", "left")  # the end a truncated text loses tokens from


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class Bucket:
    batch: int
    seq_len: int
    library: str  # path in the package
    weights: tuple[str, ...]  # keys in the weights file, in the order main takes them
    cost_ms: float  # median latency measured at export: what the planner minimizes
    tokens: int | None = None  # a packed bucket's token capacity; None: padded

    @property
    def capacity(self) -> int:
        return self.tokens or self.batch * self.seq_len

    def contains(self, other: Bucket) -> bool:
        """Every group of rows ``other`` takes, this one takes too (a packed bucket takes no row masked whole)."""
        return (other.batch <= self.batch and other.seq_len <= self.seq_len and other.capacity <= self.capacity
                and (self.tokens is None or other.tokens is not None))


class ExportedModel:
    """``model(texts)`` or ``model(input_ids, attention_mask=..., ...)``; see ``run`` and ``encode``.

    Thread-safe: one lock around the bucket runs (a VM keeps per-call state in registers, and
    each run already uses every core); padding and trimming run outside it, in parallel. Per-thread
    VMs instead compete for the cores and took longer (docs/deploy.md, Threads). The cost of the
    lock: a short call may wait for a long one in flight."""

    def __init__(self, path: str | Path, device=None, warn=None, variant: str | None = None):
        import tvm
        from tvm import relax

        self.path = Path(path)
        self.manifest = _read_manifest(self.path)
        try:  # a manifest of another shape than export writes (hand-made, or of a package written before checksums)
            _verify_files(self.path, self.manifest["files"])
            self.variant = self._choose_variant(warn or (lambda message: warnings.warn(message, stacklevel=3)), variant)
            target = self.variant["target"]
            self.device = device or {"llvm": tvm.cpu, "cuda": tvm.cuda, "rocm": tvm.rocm}[target["kind"]](0)
            self.inputs = self.manifest["inputs"]  # [{name, limit, pad}], in the order main takes them
            self.outputs = self.manifest["outputs"]  # [{name, per_token}]
            self.input_names = tuple(i["name"] for i in self.inputs)
            self.output_names = tuple(o["name"] for o in self.outputs)
            self.buckets = _monotone([Bucket(int(b["batch"]), int(b["seq_len"]), b["library"], tuple(b["weights"]),
                                             float(b.get("cost_ms") or b.get("tokens") or b["batch"] * b["seq_len"]), b.get("tokens"))
                                      for b in self.variant["buckets"]])
            self.max_batch = max(b.batch for b in self.buckets)
            self.max_seq_len = max(b.seq_len for b in self.buckets)
            unlisted = [name for name in (*(b.library for b in self.buckets), self.manifest["weights_file"])
                        if name not in self.manifest["files"]]
            if unlisted:
                raise PackageError(f"{self.path}: {', '.join(unlisted)} not among the package's checksummed files")
            amx = bool(self.variant.get("amx_kernels"))
            self._mains = [relax.VirtualMachine(load_library(self.path / b.library, target, amx, PackageError), self.device)["main"]
                           for b in self.buckets]
            self._weights = self._load_weights()
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise PackageError(f"{self.path / MANIFEST_FILE}: not a manifest tvmbert export writes ({type(exc).__name__}: "
                               f"{exc}); export the package again") from None
        self._lock = threading.Lock()
        self._tokenizer = None
        self._truncating: dict[str, object] = {}  # by direction
        self._windowing: dict[int, object] = {}  # by stride
        self._tokenizer_lock = threading.Lock()

    @property
    def task(self) -> str:
        """The head it was exported with (a core.families TASKS key). Packages written before
        export recorded it: read off the outputs, per-token logits with labels being a token
        classifier's."""
        recorded = self.manifest["model"].get("task")
        if recorded:
            return recorded
        names = {o["name"]: o["per_token"] for o in self.outputs}
        if "start_logits" in names:
            return "question-answering"
        if "last_hidden_state" in names:
            return "feature-extraction"
        if not names.get("logits"):
            return "text-classification"
        return "token-classification" if self.manifest.get("labels") else "fill-mask"

    @property
    def _scores_choices(self) -> bool:
        task = TASKS.get(self.task)
        return bool(task and task.choice_rows)

    # ---- loading ---------------------------------------------------------------------------

    def _choose_variant(self, warn, wanted: str | None) -> dict:
        """The build this machine runs fastest: its own CPU's, else the one using the most of the
        instruction sets this CPU has. Another CPU may lack the instructions a variant uses (its
        code would die on SIGILL), another GPU architecture not run it at all: such variants are
        passed over, and a package with none left is refused."""
        variants = variants_of(self.manifest)
        kind = variants[0]["target"]["kind"]
        try:
            here = targets.resolve(kind)
        except InputError as exc:
            raise PackageError(f"{self.path}: built for {_keys(variants)}, which this machine cannot run: {exc}") from None
        if kind != "llvm" and not here.device_present():
            raise PackageError(f"{self.path}: built for {_keys(variants)}, and this machine has no {kind} device")
        if wanted is not None:
            variants = [v for v in variants if v["target_key"] == wanted]
            if not variants:
                raise PackageError(f"{self.path} has no build for {wanted}: it has {_keys(variants_of(self.manifest))}")
        lacking = [missing_for(v) for v in variants]
        runnable = [v for v, missing in zip(variants, lacking) if not missing]
        if not runnable:
            missing = "; ".join(f"{v['target_key']}: {', '.join(m)}{amx_note(m)}" for v, m in zip(variants, lacking))
            raise PackageError(f"{self.path} holds builds for {_keys(variants)} only, and this CPU ({here.key}) lacks instruction "
                               f"sets each uses ({missing}): running one would kill the process. Export it with a variant for "
                               f"this CPU (tvmbert export --cpus native,...)")
        chosen = max(runnable, key=lambda v: (v["target_key"] == here.key, _instruction_sets(v["target"])))
        if chosen["target_key"] != here.key:
            warn(f"{self.path}: running its {chosen['target_key']} build on this {here.key} machine (this CPU has every "
                 f"instruction set it uses), maybe slower than one built here; export on this machine for its own kernels")
        return chosen

    def _load_weights(self) -> dict:
        """Every distinct array once on the device, shared by the buckets that read it."""
        import tvm

        wanted = {key for bucket in self.buckets for key in bucket.weights}
        stored = self.manifest["weights"]
        with np.load(self.path / self.manifest["weights_file"]) as data:
            arrays = {}
            for key in sorted(wanted):
                arrays[key] = tvm.runtime.tensor(from_bits(data[key], stored[key]["dtype"]), self.device)
        return arrays

    # ---- calls -----------------------------------------------------------------------------

    def __call__(self, *args, **named):
        """Texts (a string, a list of strings or of (text, pair) tuples) go to ``encode``;
        arrays to ``run``."""
        if args and _is_text(args[0]):
            return self.encode(*args, **named)
        if args and not named and _not_inputs(args[0]) is not None:
            raise InputError(f"a model takes texts (a string, or a non-empty list of strings or of (text, pair) tuples) "
                             f"or integer arrays of token ids; got {_not_inputs(args[0])}")
        return self.run(*args, **named)

    def encode(self, texts) -> dict:
        """Tokenizes and runs; per-token outputs come back as one array per text, trimmed to its
        tokens; per-sequence outputs (pooled, logits) as one array over the texts."""
        return self.run_encodings(self.tokenize(texts))

    def tokenize(self, texts, truncate: bool = False, direction: str = "right") -> list:
        """The texts' encodings (the ``tokenizers`` package's). A text over the largest bucket is an
        InputError, or with ``truncate`` cut to it as the tokenizer truncates (special tokens kept;
        a pair's longer text first), its tokens dropped from the ``direction`` end ("left": its
        start, keeping its end)."""
        if direction not in TRUNCATION_DIRECTIONS:
            raise InputError(f"direction must be {' or '.join(TRUNCATION_DIRECTIONS)}, got {direction!r}")
        if isinstance(texts, (str, tuple)):
            texts = [texts]
        if not isinstance(texts, list) or not texts or not all(_is_text(t) for t in texts):
            raise InputError("encode takes a string, or a non-empty list of strings or of (text, pair) tuples of strings")
        for index, text in enumerate(texts):
            _check_unicode(f"text {index}", "".join(text))
        encodings = (self._truncating_tokenizer(direction) if truncate else self.tokenizer()).encode_batch(texts)
        lengths = [len(e.ids) for e in encodings]
        if max(lengths) > self.max_seq_len:
            longest = int(np.argmax(lengths))
            raise InputError(f"text {longest} has {lengths[longest]} tokens; this package takes at most {self.max_seq_len} "
                             f"(its largest bucket): shorten it, or export with a larger --seq-len")
        return encodings

    def tokenize_windows(self, question: str, context: str, stride: int) -> list:
        """A question and its context as encodings of at most the largest bucket each: the
        question whole in every one, the context cut into windows that overlap by ``stride``
        tokens (at most half of what a window holds of it), as transformers' question-answering
        pipeline cuts a long context (its ``doc_stride``)."""
        _check_unicode("the question", question)
        _check_unicode("the context", context)
        question_tokens = len(self.tokenizer().encode(question, add_special_tokens=False).ids)
        room = self.max_seq_len - question_tokens - len(self.tokenizer().encode("", "").ids)  # what a window has for context
        if room < 2:
            raise InputError(f"the question has {question_tokens} tokens: with the context's it must fit this package's "
                             f"largest bucket ({self.max_seq_len} tokens) with room for the context")
        stride = max(0, min(stride, room // 2))
        with self._tokenizer_lock:
            if stride not in self._windowing:
                if len(self._windowing) >= WINDOWING_KEPT:  # the oldest goes: a client may send any stride
                    del self._windowing[next(iter(self._windowing))]
                self._windowing[stride] = self._loaded_tokenizer(max_length=self.max_seq_len, stride=stride,
                                                                 strategy="only_second")
            tokenizer = self._windowing[stride]
        first = tokenizer.encode(question, context)
        return [first, *first.overflowing]

    def run_encodings(self, encodings, plan: list[tuple[int, list[int]]] | None = None) -> dict:
        """``encode`` of texts ``tokenize`` encoded (a server tokenizes each request as it comes,
        and runs many requests' encodings at once); ``plan``: ``plan``'s answer for their
        lengths, where the caller made it already (to count the padding it runs)."""
        lengths = np.array([len(e.ids) for e in encodings])
        width = int(lengths.max())
        fields = {"input_ids": "ids", MASK_INPUT: "attention_mask", "token_type_ids": "type_ids"}
        missing = [name for name in self.input_names if name not in fields]
        if missing:
            raise InputError(f"this model takes {', '.join(missing)}, which a tokenizer does not give: call run() with arrays")
        arrays = {}
        for name in self.input_names:
            array = np.full((len(encodings), width), self._pad(name), dtype=np.int64)
            for row, encoding in enumerate(encodings):
                array[row, : lengths[row]] = getattr(encoding, fields[name])
            arrays[name] = array
        results = self._run_checked(arrays, lengths, plan)
        return {name: ([values[row, : lengths[row]] for row in range(len(encodings))] if self._per_token(name) else values)
                for name, values in results.items()}

    def run(self, *arrays, **named) -> dict:
        """Integer arrays [batch, length] (NumPy, or torch tensors: the outputs are then torch
        tensors too), positional in the order of ``input_names`` or by name. A missing
        attention_mask is all ones; another missing input is its pad value (token_type_ids: 0).
        Returns {output name: array}: per-token outputs [batch, length, ...], zero after each
        row's last unmasked token; per-sequence outputs [batch, ...]. A multiple-choice model
        takes [questions, choices, length] too, as transformers' does, and gives logits
        [questions, choices]; given [rows, length], it scores each row: logits [rows, 1]."""
        if len(arrays) > len(self.input_names):
            raise InputError(f"this model takes {len(self.input_names)} inputs ({', '.join(self.input_names)}), got {len(arrays)}")
        given = dict(zip(self.input_names, arrays))
        for name, value in named.items():
            if name not in self.input_names:
                raise InputError(f"unknown input '{name}': this model takes {', '.join(self.input_names)}")
            if name in given:
                raise InputError(f"input '{name}' given twice")
            given[name] = value
        first = self.input_names[0]
        if given.get(first) is None:
            raise InputError(f"{first} is required")
        as_torch = any(is_torch(v) for v in given.values())
        checked = {name: as_integers(name, value) for name, value in given.items() if value is not None}
        shape = checked[first].shape
        grouped = self._scores_choices and len(shape) == 3
        if len(shape) != 2 + grouped or 0 in shape:
            dims = "[batch, length] or [questions, choices, length]" if self._scores_choices else "[batch, length]"
            raise InputError(f"{first} must be {dims} with every size > 0, got shape {list(shape)}")
        for name, array in checked.items():
            if array.shape != shape:
                raise InputError(f"{name} has shape {list(array.shape)} and {first} {list(shape)}: they must be equal")
        questions = shape[:2] if grouped else None
        if grouped:  # one (question, choice) row each, as transformers' head flattens them
            checked = {name: array.reshape(-1, shape[2]) for name, array in checked.items()}
            shape = checked[first].shape
        if shape[1] > self.max_seq_len:
            raise InputError(f"length {shape[1]} is above this package's largest bucket ({self.max_seq_len}): "
                             "export with a larger --seq-len")
        for name in self.input_names:
            if name not in checked:
                checked[name] = np.ones(shape, np.int64) if name == MASK_INPUT else np.full(shape, self._pad(name), np.int64)
        lengths = packing.lengths(checked.get(MASK_INPUT), shape)
        results = self._run_checked(checked, lengths)
        for name, values in results.items():
            if self._per_token(name):
                full = np.zeros((shape[0], shape[1], *values.shape[2:]), values.dtype)
                for row, length in enumerate(lengths):
                    full[row, :length] = values[row, :length]
                results[name] = full
        if questions is not None:
            results = {name: values.reshape(questions) for name, values in results.items()}
        if as_torch:
            torch = sys.modules["torch"]
            return {name: torch.from_numpy(values) for name, values in results.items()}
        return results

    # ---- the planner and the bucket runs ---------------------------------------------------

    def plan(self, lengths, packable=None) -> list[tuple[int, list[int]]]:
        """[(bucket index, rows)]: every row once, in a bucket at least as long as it (a packed
        one only for groups whose tokens it holds, with no row in ``packable`` false: rows
        masked whole), with the least total measured cost (rows sorted longest first, then a
        dynamic program over consecutive groups)."""
        order = sorted(range(len(lengths)), key=lambda row: -lengths[row])
        count = len(order)
        best = [0.0] * (count + 1)
        choice: list[tuple[int, int]] = [(0, 0)] * count
        for start in range(count - 1, -1, -1):
            longest = lengths[order[start]]
            best[start] = float("inf")
            long_enough = [(b.cost_ms, i) for i, b in enumerate(self.buckets) if b.seq_len >= longest]
            padded = self._cheapest_padded(long_enough)
            packed = [(cost, i) for cost, i in long_enough if self.buckets[i].tokens is not None]
            tokens, packs = 0, True
            for size in range(1, min(self.max_batch, count - start) + 1):
                tokens += lengths[order[start + size - 1]]
                packs = packs and (packable is None or bool(packable[order[start + size - 1]]))
                fits = [padded[size]] if padded[size] else []
                if packs:
                    fits += [(cost, i) for cost, i in packed if self.buckets[i].batch >= size and tokens <= self.buckets[i].tokens]
                if not fits:
                    continue
                index = min(fits)[1]
                total = self.buckets[index].cost_ms + best[start + size]
                if total < best[start]:
                    best[start], choice[start] = total, (index, size)
        if best[0] == float("inf"):
            raise InputError("a row masked whole needs a padded bucket, and this package has only packed ones for it: "
                             "export with batch 1 too")
        groups, start = [], 0
        while start < count:
            index, size = choice[start]
            groups.append((index, order[start : start + size]))
            start += size
        return groups

    def _cheapest_padded(self, buckets: list[tuple[float, int]]) -> list[tuple[float, int] | None]:
        """For each row count up to the largest batch, the cheapest padded bucket of ``buckets``
        ((cost, index), long enough already) that takes as many rows (of equal costs, the first):
        the planner asks it for every group it weighs."""
        by_batch: list[tuple[float, int] | None] = [None] * (self.max_batch + 2)
        for cost, index in buckets:
            if self.buckets[index].tokens is None:
                batch = self.buckets[index].batch
                by_batch[batch] = min(by_batch[batch] or (cost, index), (cost, index))
        for size in range(self.max_batch, 0, -1):  # a bucket of more rows takes fewer too
            if by_batch[size + 1] is not None:
                by_batch[size] = min(by_batch[size] or by_batch[size + 1], by_batch[size + 1])
        return by_batch

    def _run_checked(self, arrays: dict[str, np.ndarray], lengths, plan=None) -> dict[str, np.ndarray]:
        """Checks every value against its range (TVM's take reads past the table for an id out
        of it: garbage, NaN or a segfault), then runs the plan; outputs in the rows' order."""
        for spec in self.inputs:
            array = arrays[spec["name"]]
            check_range(spec["name"], array, spec["limit"])
        lengths = [int(n) for n in lengths]
        results: dict[str, np.ndarray] = {}
        for index, rows in plan or self.plan(lengths, arrays[MASK_INPUT].any(axis=1)):
            outputs = self._run_bucket(index, {name: array[rows] for name, array in arrays.items()}, [lengths[r] for r in rows])
            for spec, values in zip(self.outputs, outputs):
                if spec["name"] not in results:
                    width = (max(lengths),) if spec["per_token"] else ()
                    tail = values.shape[2:] if spec["per_token"] else values.shape[1:]
                    results[spec["name"]] = np.zeros((len(lengths), *width, *tail), values.dtype)
                for slot, row in enumerate(rows):
                    if spec["per_token"]:
                        results[spec["name"]][row, : lengths[row]] = values[slot, : lengths[row]]
                    else:
                        results[spec["name"]][row] = values[slot]
        return results

    def _run_bucket(self, index: int, arrays: dict[str, np.ndarray], lengths: list[int]) -> list[np.ndarray]:
        """Rows padded to the bucket's shape (ids with their pad value, mask 0), or packed into a
        packed bucket's stream, run once; per-token outputs come back as [rows, seq_len, ...]."""
        import tvm

        bucket = self.buckets[index]
        if bucket.tokens is None:
            feeds = []
            for name in self.input_names:
                padded = np.full((bucket.batch, bucket.seq_len), 0 if name == MASK_INPUT else self._pad(name), np.int64)
                for slot, length in enumerate(lengths):
                    padded[slot, :length] = arrays[name][slot, :length]
                feeds.append(padded)
        else:
            packed = packing.pack(arrays, lengths, bucket.batch, bucket.seq_len, bucket.tokens, self.manifest["packing"]["positions"])
            feeds = [packed[name] for name in packing.input_names(self.input_names)]
        feeds = [tvm.runtime.tensor(feed, self.device) for feed in feeds]
        with self._lock:
            outputs = self._mains[index](*feeds, *(self._weights[key] for key in bucket.weights))
            if hasattr(outputs, "numpy"):  # a single output comes back bare
                outputs = [outputs]
            outputs = [out.numpy() for out in outputs]
        if bucket.tokens is None:
            return outputs
        return [packing.unpack(out, lengths, bucket.seq_len) if spec["per_token"] else out for spec, out in zip(self.outputs, outputs)]

    # ---- helpers ---------------------------------------------------------------------------

    def _pad(self, name: str) -> int:
        return next(spec["pad"] for spec in self.inputs if spec["name"] == name)

    def _per_token(self, name: str) -> bool:
        return next(spec["per_token"] for spec in self.outputs if spec["name"] == name)

    def tokenizer(self):
        """The package's tokenizer (the ``tokenizers`` package), without truncation or padding:
        a text longer than the largest bucket is an error, never silently cut."""
        if self.manifest.get("tokenizer") is None:
            raise InputError(f"{self.path} has no tokenizer (the model had none): call run() with token ids")
        with self._tokenizer_lock:
            if self._tokenizer is None:
                try:
                    import tokenizers  # noqa: F401 - said here, once: the other tokenizers load after this one
                except ImportError:
                    raise InputError("encoding text needs the tokenizers package: pip install tokenizers") from None
                self._tokenizer = self._loaded_tokenizer()
        return self._tokenizer

    def _truncating_tokenizer(self, direction: str):
        """The tokenizer cutting each text to the largest bucket from ``direction`` (TEI's
        ``truncate`` and ``truncation_direction``)."""
        self.tokenizer()  # the same checks first (it takes the lock itself)
        with self._tokenizer_lock:
            if direction not in self._truncating:
                self._truncating[direction] = self._loaded_tokenizer(max_length=self.max_seq_len, direction=direction)
        return self._truncating[direction]

    def _loaded_tokenizer(self, **truncation):
        """A tokenizer of its own from the package's file (each is configured once, then only
        read: sharing one and reconfiguring it per call would race), never padding, truncating
        as ``truncation`` says (``tokenizers``' ``enable_truncation`` arguments) or not at all."""
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(self.path / self.manifest["tokenizer"]))
        tokenizer.no_padding()
        if truncation:
            tokenizer.enable_truncation(**truncation)
        else:
            tokenizer.no_truncation()
        return tokenizer

    def __repr__(self) -> str:
        shapes = ", ".join(f"{b.batch}x{b.seq_len}" + (f"/{b.tokens}" if b.tokens else "") for b in self.buckets)
        return f"ExportedModel({self.manifest['model']['name']}, {self.variant['target_key']}, buckets {shapes})"


def load(path: str | Path, device=None, warn=None, variant: str | None = None) -> ExportedModel:
    """Loads a package `tvmbert export` wrote: checksums verified, the fastest build this machine
    can run chosen (``variant``: a target key, to load that build instead; ``.variant`` says which),
    built-for-another-machine warned about (``warn``: a callable taking the message; default
    ``warnings.warn``)."""
    return ExportedModel(path, device, warn, variant)


def variants_of(manifest: dict) -> list[dict]:
    """A package's builds, one per CPU (a fleet package, format VARIANTS_FORMAT) or its one build:
    each {target, target_key, buckets, amx_kernels}."""
    if "variants" in manifest:
        return manifest["variants"]
    return [{key: manifest.get(key) for key in ("target", "target_key", "buckets", "amx_kernels")}]


def missing_for(variant: dict) -> list[str]:
    """What this CPU lacks of what a variant's code uses (its AMX kernels' tile state too)."""
    return targets.missing_host_features(variant["target"], bool(variant.get("amx_kernels")))


def _keys(variants: list[dict]) -> str:
    return ", ".join(v["target_key"] for v in variants)


def _instruction_sets(target: dict) -> int:
    """How many of the checked instruction sets code for ``target`` may use: a wider ISA runs faster."""
    return len(targets.compiled_instruction_sets(target))


def _monotone(buckets: list[Bucket]) -> list[Bucket]:
    """A bucket costs at least what any bucket it contains costs: a latency measured on a busy
    machine may say otherwise, and the planner would then pad for nothing."""
    return [replace(b, cost_ms=max(o.cost_ms for o in buckets if b.contains(o))) for b in buckets]


def write_manifest(folder: Path, manifest: dict) -> None:
    """The manifest and its checksum, each written atomically."""
    artifacts.write_json(folder / MANIFEST_FILE, manifest)
    artifacts.write_text(folder / MANIFEST_CHECKSUM_FILE, sha256(folder / MANIFEST_FILE) + "\n")


def _read_manifest(path: Path) -> dict:
    file = path / MANIFEST_FILE
    if not file.is_file():
        raise PackageError(f"{path} is not a tvmbert package: it has no {MANIFEST_FILE} (write one with `tvmbert export`)")
    checksum = path / MANIFEST_CHECKSUM_FILE
    if checksum.is_file() and checksum.read_text().strip() != sha256(file):
        raise PackageError(f"{path}: {MANIFEST_FILE} does not match {MANIFEST_CHECKSUM_FILE}: it was edited or damaged after "
                           "export; export the package again")
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PackageError(f"{file} cannot be read: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in FORMATS:
        raise PackageError(f"{file}: package format {manifest.get('format') if isinstance(manifest, dict) else None!r}; "
                           f"this tvmbert reads formats {', '.join(map(str, FORMATS))}")
    return manifest


def _verify_files(path: Path, files: dict[str, str]) -> None:
    for name, expected in sorted(files.items()):
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise PackageError(f"{path}: {MANIFEST_FILE} names {name}, outside the package")
        file = path / name
        if not file.is_file():
            raise PackageError(f"{path}: {name} is missing")
        if sha256(file) != expected:
            raise PackageError(f"{path}: {name} does not match its checksum in {MANIFEST_FILE}: the file was altered or "
                               "damaged; export the package again")


def _not_inputs(value) -> str | None:
    """What ``value`` is, where it is neither text nor token ids: an empty list, bytes (texts to
    decode first), a list of them; None for anything else (``run`` checks arrays)."""
    if isinstance(value, list) and not value:
        return "an empty list"
    if isinstance(value, (bytes, bytearray)) or (isinstance(value, list) and any(isinstance(v, (bytes, bytearray)) for v in value)):
        return "bytes: decode them to str first"
    return None


def _check_unicode(what: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"{what} holds a lone surrogate at {exc.start}: not Unicode text") from None


def _is_text(value) -> bool:
    return isinstance(value, str) or (isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, str) for v in value)) \
        or (isinstance(value, list) and bool(value) and all(_is_text(v) and not isinstance(v, list) for v in value))
