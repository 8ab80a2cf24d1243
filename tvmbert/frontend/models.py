"""Where models come from: preset architectures with seeded weights, or a local HF directory.

Weights never come from the network: presets are built from a config and a seed, and local
directories are opened with ``local_files_only``.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tvmbert.core.errors import InputError
from tvmbert.core.families import DEFAULT_TASK, FAMILIES, PRESETS, TASKS, Family, preset_config_kwargs, task_of_architecture
from tvmbert.core.memory import ModelSizes
from tvmbert.frontend import exact

if TYPE_CHECKING:
    import torch

# The HuggingFace TorchScript tutorial's example, the seed post's input (1 x 14 tokens).
DEFAULT_TEXT = "[CLS] Who was Jim Henson ? [SEP] Jim Henson was a puppeteer [SEP]"
DEFAULT_SEQ_LEN = 14


def stay_offline() -> None:
    """Weights never come from the network: transformers and its hub read this when imported (the
    CLI and a Job call it first). A user who sets it to 0 still never reaches a hub: every load
    passes local_files_only."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Families whose embeddings skip segment ids at type_vocab_size 0 (the others would index an empty table).
UNTYPED_FAMILIES = ("deberta-v2",)

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class ModelSource:
    """A resolved model reference: what to build and a key that names its artifacts."""

    name: str  # what the user typed
    key: str  # directory-safe, unique per architecture + weights
    preset: str | None
    path: Path | None
    fingerprint: str  # changes when the config or the weights change
    max_positions: int
    vocab_size: int  # input_ids are in [0, vocab_size)
    type_vocab_size: int  # token_type_ids are in [0, type_vocab_size); RoBERTa-style models have 1
    family: str  # a FAMILIES key (config.json's model_type)
    task: str  # a TASKS key
    # A directory's weights it lacks may be drawn at random (seeded), for experiments: never by default.
    random_weights_allowed: bool = False

    @property
    def inputs(self) -> tuple[str, ...]:
        """What the compiled model takes, in order: no segment ids where its config has no kinds
        of them (DeBERTa-v3's type_vocab_size 0: its embeddings never read them)."""
        inputs = FAMILIES[self.family].inputs
        return inputs if self.type_vocab_size else tuple(name for name in inputs if name != "token_type_ids")

    @property
    def input_limits(self) -> dict[str, int]:
        """Each input's values lie in [0, limit)."""
        limits = {"input_ids": self.vocab_size, "attention_mask": 2, "token_type_ids": self.type_vocab_size}
        return {name: limits[name] for name in self.inputs}


def _hash(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def resolve(name: str, seed: int = 0, task: str | None = None, allow_random_weights: bool = False) -> ModelSource:
    """Turns a preset name or a directory path into a ModelSource, or says clearly why not.
    ``task``: the head to compile; None takes the one config.json's ``architectures`` names.
    ``allow_random_weights``: a directory's missing weights are drawn at random from ``seed``
    instead of refused."""
    if task is not None and task not in TASKS:
        close = difflib.get_close_matches(task, TASKS, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise InputError(f"unknown task '{task}': tvmbert compiles {', '.join(TASKS)}{hint}")
    if name in PRESETS:
        preset = PRESETS[name]
        task = task or DEFAULT_TASK
        return ModelSource(
            name=name,
            key=(name if seed == 0 else f"{name}-seed{seed}") + _task_suffix(task),
            preset=name,
            path=None,
            fingerprint=_hash(json.dumps(preset_config_kwargs(preset), sort_keys=True), f"seed={seed}", f"task={task}"),
            max_positions=preset.max_positions,
            vocab_size=preset.vocab_size,
            type_vocab_size=preset.type_vocab_size,
            family=preset.family,
            task=task,
        )
    path = Path(name).expanduser()
    looks_like_path = os.sep in name or name.startswith(".") or path.exists()
    if not looks_like_path:
        close = difflib.get_close_matches(name, PRESETS, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise InputError(
            f"unknown model '{name}': not a preset ({', '.join(PRESETS)}) nor an existing directory{hint}"
        )
    if not path.exists():
        raise InputError(f"model directory '{name}' does not exist")
    if not path.is_dir():
        raise InputError(f"'{name}' is a file, not a model directory (one with config.json and weights)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise InputError(f"'{name}' is not a HuggingFace model directory: config.json is missing")
    try:
        config_json = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{config_file}: not valid JSON ({exc})") from None
    if not isinstance(config_json, dict):
        raise InputError(f"{config_file}: not a JSON object of settings (it holds a {type(config_json).__name__})")
    model_type = config_json.get("model_type")
    if model_type is None:
        parent = Path(os.path.abspath(path)).parent  # the folder above as typed, not a link's target's
        hint = f"; did you mean its parent '{parent}'?" if _names_a_family(parent / "config.json") else ""
        raise InputError(f"'{name}': config.json names no model_type (tvmbert reads the family from it, e.g. \"bert\"){hint}")
    if model_type not in FAMILIES:
        raise InputError(
            f"'{name}' holds a '{model_type}' model; tvmbert handles BERT-like encoders: {', '.join(FAMILIES)}"
        )
    task = task or _task_from_architectures(name, config_json, FAMILIES[model_type])
    weights = [path / f for f in WEIGHT_FILES if (path / f).is_file()]
    if not weights:
        raise InputError(f"'{name}' has no weights: expected one of {', '.join(WEIGHT_FILES)}")
    stats = [f"{w.name}:{w.stat().st_size}:{w.stat().st_mtime_ns}" for w in weights]
    resolved = path.resolve()
    return ModelSource(
        name=name,
        key=f"{resolved.name}-{_hash(str(resolved))[:8]}{_task_suffix(task)}",
        preset=None,
        path=resolved,
        fingerprint=_hash(config_file.read_text(), *stats, f"task={task}", *([f"random-seed={seed}"] if allow_random_weights else [])),
        max_positions=_positive(config_json, "max_position_embeddings", 512, config_file),
        vocab_size=_positive(config_json, "vocab_size", 30522, config_file),
        type_vocab_size=_positive(config_json, "type_vocab_size", 2, config_file, least=0 if model_type in UNTYPED_FAMILIES else 1),
        family=model_type,
        task=task,
        random_weights_allowed=allow_random_weights,
    )


def _task_suffix(task: str) -> str:
    """Artifacts of a head apart from the bare encoder's (their key names the task)."""
    return "" if task == DEFAULT_TASK else f"-{task}"


def _names_a_family(config_file: Path) -> bool:
    """Whether ``config_file`` is a model's settings for one of our families (a sentence-transformers
    model keeps its modules' settings in folders below the model's own)."""
    try:
        settings = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(settings, dict) and settings.get("model_type") in FAMILIES


def _task_from_architectures(name: str, config_json: dict, family: Family) -> str:
    """The head config.json's ``architectures`` names; a head tvmbert cannot compile is an error,
    never dropped in silence (the user would get hidden states instead of their logits)."""
    architectures = config_json.get("architectures") or []
    if not isinstance(architectures, list) or not architectures:
        return DEFAULT_TASK
    architecture = str(architectures[0])
    task = task_of_architecture(architecture, family)
    if task is None:
        supported = ", ".join(f"{family.model_prefix}{t.class_suffix} ({n})" for n, t in TASKS.items())
        raise InputError(f"'{name}' is a {architecture}, a head tvmbert does not compile; it compiles {supported}. "
                         f"--task feature-extraction compiles its encoder alone")
    return task


def _positive(config_json: dict, key: str, default: int, config_file: Path, least: int = 1) -> int:
    """A size from config.json, checked here: a bad one would otherwise fail deep in transformers."""
    value = config_json.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InputError(f"{config_file}: '{key}' must be a number >= {least}, got {value!r}")
    return value


def preset_config(name: str, task: str = DEFAULT_TASK):
    """The transformers config of a preset: its family's defaults, the preset's sizes, eager attention."""
    import transformers

    preset = PRESETS[name]
    sizes = {**preset_config_kwargs(preset), "vocab_size": preset.vocab_size, "max_position_embeddings": preset.max_positions}
    if "token_type_ids" in FAMILIES[preset.family].inputs:
        sizes["type_vocab_size"] = preset.type_vocab_size
    if TASKS[task].fixed_labels:
        sizes["num_labels"] = TASKS[task].fixed_labels
    return getattr(transformers, FAMILIES[preset.family].config_class)(**sizes, attn_implementation="eager")


@functools.cache
def sizes(source: ModelSource) -> ModelSizes:
    """What the memory estimate and bench's floor need, from the config alone: the model built on
    torch's meta device (no weights read or allocated) for its parameter count, and its weight
    matmuls' distinct weights (its Linear layers of the encoder's shapes, each once where layers
    share them)."""
    import torch
    import transformers

    if source.preset is not None:
        config = preset_config(source.preset, source.task)
    else:
        config = transformers.AutoConfig.from_pretrained(source.path, local_files_only=True)
    with torch.device("meta"):
        model = model_class(source)(config)
    intermediate = getattr(config, "intermediate_size", None) or getattr(config, "hidden_dim", None) or 4 * config.hidden_size
    layers = getattr(config, "num_hidden_layers", None) or config.n_layers  # DistilBERT's config names it n_layers
    matmul_shapes = {(config.hidden_size, config.hidden_size), (intermediate, config.hidden_size), (config.hidden_size, intermediate)}
    # And those of the first layer's own (ModernBERT's fused QKV, 3 H x H, and GeGLU's 2 I x H).
    first_layer = FAMILIES[source.family].layers(model.base_model)[0]
    matmul_shapes |= {tuple(m.weight.shape) for m in first_layer.modules() if isinstance(m, torch.nn.Linear)}
    matmul_weights = {id(m.weight): m.weight.numel() for m in model.modules()
                      if isinstance(m, torch.nn.Linear) and tuple(m.weight.shape) in matmul_shapes}
    layer_macs = sum(m.weight.numel() for m in first_layer.modules() if isinstance(m, torch.nn.Linear))
    return ModelSizes(sum(p.numel() for p in model.parameters()), config.hidden_size, intermediate, config.num_attention_heads,
                      layers, sum(matmul_weights.values()), layer_macs, FAMILIES[source.family].attention_keys(config))


def model_class(source: ModelSource):
    """The transformers class of the source's family with its task's head."""
    import transformers

    return getattr(transformers, FAMILIES[source.family].model_prefix + TASKS[source.task].class_suffix)


def load(source: ModelSource, dtype: str = "float32", seed: int = 0, attn_implementation: str = "eager"):
    """The PyTorch module in eval mode, with a positional signature (the family's inputs, in
    order) returning a tuple: the task's outputs, in order (``.input_names``, ``.output_names``)."""
    import torch

    class TaskOutputs(torch.nn.Module):
        """Fixes the signature to the family's inputs -> the task's outputs, as a tuple."""

        def __init__(self, model: torch.nn.Module, input_names: tuple[str, ...], output_names: tuple[str, ...],
                     choice_rows: bool):
            super().__init__()
            self.model, self.input_names, self.output_names, self.choice_rows = model, input_names, output_names, choice_rows

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            """Named as the compiled model's inputs are (torch.export takes the names from here).
            A multiple-choice head gets each row as a question with one choice."""
            given = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
            out = self.model(**{name: given[name][:, None] if self.choice_rows else given[name] for name in self.input_names})
            return tuple(out[name] for name in self.output_names)

    if attn_implementation == "eager" and dtype == "float64" and FAMILIES[source.family].softmax_in_float32:
        attn_implementation = exact.float64_attention()
    if source.preset is not None:
        config = preset_config(source.preset, source.task)
        config._attn_implementation = attn_implementation
        torch.manual_seed(seed)
        model = model_class(source)(config)
    else:
        model = _from_directory(source, attn_implementation, seed)
    if tables := FAMILIES[source.family].position_tables:
        exact.POSITION_TABLES[tables](model.base_model, source.max_positions)
    outputs = TASKS[source.task].outputs
    if getattr(model, "pooler", None) is None:  # DistilBERT, ELECTRA, and encoders saved without one
        outputs = tuple(name for name in outputs if name != "pooler_output")
    wrapped = TaskOutputs(model, source.inputs, outputs, TASKS[source.task].choice_rows).to(getattr(torch, dtype)).eval()
    wrapped.random_weights = getattr(model, "random_weights", ())
    return wrapped


def _from_directory(source: ModelSource, attn_implementation: str, seed: int):
    """The model in a HuggingFace directory, or an InputError: everything read here is the user's
    files (truncated or garbage weights, weights of other shapes than config.json says, weights
    missing)."""
    import torch

    torch.manual_seed(seed)  # weights it lacks, where allowed, are the same in every stage's load
    try:
        with _transformers_quiet():  # its load report is a table; what matters in it is said below
            model, info = model_class(source).from_pretrained(source.path, local_files_only=True,
                                                              attn_implementation=attn_implementation,
                                                              output_loading_info=True, ignore_mismatched_sizes=True)
    except Exception as exc:  # noqa: BLE001 - safetensors, pickle, torch and transformers each raise their own
        raise _unreadable("the model", source, exc) from None
    mismatched = sorted(info["mismatched_keys"])
    if mismatched:
        key, stored, expected = mismatched[0]
        raise InputError(f"the weights in '{source.name}' do not match its config.json: {key} is {list(stored)} in the "
                         f"weight file and {list(expected)} by config.json ({len(mismatched)} weights differ)")
    fixed = TASKS[source.task].fixed_labels
    if fixed and model.config.num_labels != fixed:
        raise InputError(f"'{source.name}' has num_labels {model.config.num_labels}; a {source.task} head has {fixed}")
    model.random_weights = _missing_weights(model, info["missing_keys"])
    if source.task == DEFAULT_TASK and model.random_weights and all(k.startswith("pooler.") for k in model.random_weights):
        # An encoder saved without its pooler (sentence-transformers often are): compiled without
        # it, pooler_output left out, rather than a random one computed.
        print(f"note: '{source.name}' has no pooler weights: compiled without pooler_output", file=sys.stderr)
        model.pooler, model.random_weights = None, ()
    if model.random_weights:
        names = f"{', '.join(model.random_weights[:4])}{', ...' if len(model.random_weights) > 4 else ''}"
        if not source.random_weights_allowed:
            way_out = ("--task feature-extraction compiles the encoder alone" if source.task != DEFAULT_TASK
                       else "save the model with all its weights")
            raise InputError(f"'{source.name}' has no weights for {names} ({len(model.random_weights)} tensors): compiled, they "
                             f"would be random and its answers confidently wrong. {way_out[0].upper()}{way_out[1:]}; "
                             "--allow-random-weights draws them from --seed, for experiments")
        print(f"warning: '{source.name}' has no weights for {names}: drawn at random from seed {seed} "
              "(--allow-random-weights); every report says so", file=sys.stderr)
    return model


def _missing_weights(model, missing_keys) -> tuple[str, ...]:
    """The weights a checkpoint lacks, less those tied on purpose to one it has (a decoder tied to
    the word embeddings): transformers fills those from their source, not at random."""
    missing = set(missing_keys)
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    return tuple(sorted(key for key in missing if not (key in tied and tied[key] not in missing)))


@dataclass(frozen=True)
class ExampleInputs:
    """The model's inputs by name, in the order its compiled signature takes them."""

    tensors: dict[str, torch.Tensor]

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.tensors.values())

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.tensors)

    @property
    def input_ids(self) -> torch.Tensor:
        return self.tensors["input_ids"]

    @property
    def attention_mask(self) -> torch.Tensor:
        return self.tensors["attention_mask"]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)


def make_inputs(source: ModelSource, ids, mask, segments) -> ExampleInputs:
    """The source's inputs from full (ids, mask, segment ids) rows: a family without segment ids drops them."""
    given = {"input_ids": ids, "attention_mask": mask, "token_type_ids": segments}
    return ExampleInputs({name: given[name] for name in source.inputs})


SENTENCEPIECE_FILES = ("spm.model", "spiece.model", "sentencepiece.bpe.model")  # DeBERTa-v3's, ALBERT's and T5's, XLM-R's


def tokenizer_of(source: ModelSource):
    """The model's own tokenizer, from its files. One its folder holds but transformers cannot
    read (a file of another version, a library it needs missing) is the user's to mend, in one line."""
    from transformers import AutoTokenizer

    try:
        with _transformers_quiet():  # its fallbacks' warnings ("Falling back to TikToken") say less than our line
            return AutoTokenizer.from_pretrained(source.path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 (transformers raises any kind for a folder it cannot read)
        raise _unreadable("the tokenizer", source, exc) from None


@contextlib.contextmanager
def _transformers_quiet():
    """transformers' errors alone, and no progress bars, while it reads a user's folder."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _unreadable(what: str, source: ModelSource, exc: Exception) -> InputError:
    """One line for a folder whose ``what`` a library could not read: its error's first line."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return InputError(f"cannot load {what} in '{source.name}': {type(exc).__name__}: {first[:200]}")


def has_tokenizer(source: ModelSource) -> bool:
    return source.path is not None and any(
        (source.path / f).is_file() for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", *SENTENCEPIECE_FILES)
    )


def example_inputs(source: ModelSource, batch: int, seq_len: int | None, text: str | None) -> ExampleInputs:
    """Tokenized text when the model has a tokenizer, otherwise deterministic ids of batch x seq_len."""
    import torch

    if text is not None and not has_tokenizer(source):
        raise InputError(f"--text needs a tokenizer, and '{source.name}' has none (presets never do)")
    if has_tokenizer(source):
        return _tokenized(source, batch, seq_len, text or DEFAULT_TEXT)
    seq_len = seq_len or DEFAULT_SEQ_LEN
    check_seq_len(source, seq_len)
    vocab, segment_kinds = source.vocab_size, source.type_vocab_size
    generator = torch.Generator().manual_seed(1234)
    # Ids start above the special tokens so every row looks like ordinary text.
    ids = torch.randint(1000 if vocab > 2000 else 5, vocab, (batch, seq_len), generator=generator)
    segments = torch.zeros(batch, seq_len, dtype=torch.long)
    if segment_kinds > 1:
        segments[:, seq_len // 2 :] = 1
    return make_inputs(source, ids, torch.ones(batch, seq_len, dtype=torch.long), segments)


def input_shape(source: ModelSource, batch: int, seq_len: int | None, text: str | None) -> tuple[int, int] | None:
    """The example inputs' shape when it is known without tokenizing (and importing torch)."""
    if seq_len is not None or not has_tokenizer(source):
        return batch, seq_len or DEFAULT_SEQ_LEN
    return None


def check_seq_len(source: ModelSource, seq_len: int) -> None:
    if seq_len <= 0:
        raise InputError(f"--seq-len must be positive, got {seq_len}")
    if seq_len > source.max_positions:
        raise InputError(f"--seq-len {seq_len} is above the model's max_position_embeddings ({source.max_positions})")


def _tokenized(source: ModelSource, batch: int, seq_len: int | None, text: str) -> ExampleInputs:
    import torch

    tokenizer = tokenizer_of(source)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    # Segment ids as in the TorchScript tutorial: 0 up to and including the first [SEP], then 1.
    sep = tokenizer.sep_token_id
    first_sep = ids.index(sep) if sep in ids else len(ids) - 1
    segments = [0 if i <= first_sep else 1 for i in range(len(ids))]
    if not ids:
        raise InputError(f"--text {text!r} has no tokens")
    if seq_len is not None and len(ids) > seq_len:
        raise InputError(f"--text has {len(ids)} tokens and --seq-len is {seq_len}: give a --seq-len of at least {len(ids)}, "
                         "or a shorter text")
    length = seq_len or len(ids)
    check_seq_len(source, length)
    pad = tokenizer.pad_token_id or 0
    mask = [1] * len(ids) + [0] * (length - len(ids))
    ids = ids + [pad] * (length - len(ids))
    segments = segments + [0] * (length - len(segments))
    rows = lambda values: torch.tensor([values] * batch, dtype=torch.long)  # noqa: E731
    return make_inputs(source, rows(ids), rows(mask), rows(segments))


def tokenized_texts(source: ModelSource, texts: list[str], batch: int, seq_len: int) -> list[ExampleInputs]:
    """``texts`` through the model's own tokenizer (special tokens, truncated and padded to
    ``seq_len``), in inputs of ``batch`` rows; the last one's missing rows repeat its first."""
    import torch

    tokenizer = tokenizer_of(source)
    encoded = tokenizer(texts, padding="max_length", truncation=True, max_length=seq_len, return_tensors="pt")
    given = {name: encoded[name] if name in encoded else torch.zeros_like(encoded["input_ids"]) for name in
             ("input_ids", "attention_mask", "token_type_ids")}
    inputs = []
    for start in range(0, len(texts), batch):
        rows = {name: values[start:start + batch] for name, values in given.items()}
        short = batch - len(rows["input_ids"])
        rows = {name: torch.cat([values, values[:1].expand(short, -1)]) if short else values for name, values in rows.items()}
        inputs.append(make_inputs(source, rows["input_ids"], rows["attention_mask"], rows["token_type_ids"]))
    return inputs
