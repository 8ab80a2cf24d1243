"""Where models come from: preset architectures with seeded weights, or a local HF directory.

Weights never come from the network: presets are built from a config and a seed, and local
directories are opened with ``local_files_only``.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import InputError

if TYPE_CHECKING:
    import torch

# A user who sets it to 0 still never reaches a hub: every load passes local_files_only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The HuggingFace TorchScript tutorial's example, the seed post's input (1 x 14 tokens).
DEFAULT_TEXT = "[CLS] Who was Jim Henson ? [SEP] Jim Henson was a puppeteer [SEP]"
DEFAULT_SEQ_LEN = 14
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")

PRESETS: dict[str, dict] = {
    "bert-tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=512),
    "bert-mini": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024),
    "bert-base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072),
    "bert-large": dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, intermediate_size=4096),
}

# What BertConfig's defaults (bert-base-uncased) give every preset; read without importing
# transformers, which imports torch.
PRESET_MAX_POSITIONS, PRESET_VOCAB_SIZE, PRESET_SEGMENTS = 512, 30522, 2

# model_type values whose HF model takes (input_ids, attention_mask, token_type_ids) and returns
# last_hidden_state (and pooler_output where the architecture has a pooler).
BERT_LIKE_TYPES = ("bert", "roberta", "xlm-roberta", "camembert", "electra")

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


def _hash(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def resolve(name: str, seed: int = 0) -> ModelSource:
    """Turns a preset name or a directory path into a ModelSource, or says clearly why not."""
    if name in PRESETS:
        return ModelSource(
            name=name,
            key=name if seed == 0 else f"{name}-seed{seed}",
            preset=name,
            path=None,
            fingerprint=_hash(json.dumps(PRESETS[name], sort_keys=True), f"seed={seed}"),
            max_positions=PRESET_MAX_POSITIONS,
            vocab_size=PRESET_VOCAB_SIZE,
            type_vocab_size=PRESET_SEGMENTS,
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
    if model_type not in BERT_LIKE_TYPES:
        raise InputError(
            f"'{name}' holds a '{model_type}' model; tvmbert handles BERT-like encoders: {', '.join(BERT_LIKE_TYPES)}"
        )
    weights = [path / f for f in WEIGHT_FILES if (path / f).is_file()]
    if not weights:
        raise InputError(f"'{name}' has no weights: expected one of {', '.join(WEIGHT_FILES)}")
    stats = [f"{w.name}:{w.stat().st_size}:{w.stat().st_mtime_ns}" for w in weights]
    resolved = path.resolve()
    return ModelSource(
        name=name,
        key=f"{resolved.name}-{_hash(str(resolved))[:8]}",
        preset=None,
        path=resolved,
        fingerprint=_hash(config_file.read_text(), *stats),
        max_positions=_positive(config_json, "max_position_embeddings", 512, config_file),
        vocab_size=_positive(config_json, "vocab_size", 30522, config_file),
        type_vocab_size=_positive(config_json, "type_vocab_size", 2, config_file),
    )


def _positive(config_json: dict, key: str, default: int, config_file: Path) -> int:
    """A size from config.json, checked here: a bad one would otherwise fail deep in transformers."""
    value = config_json.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{config_file}: '{key}' must be a number >= 1, got {value!r}")
    return value


def _preset_config(name: str):
    from transformers import BertConfig

    # BertConfig's defaults are the bert-base-uncased architecture; presets change the sizes only.
    return BertConfig(**PRESETS[name], attn_implementation="eager")


def load(source: ModelSource, dtype: str = "float32", seed: int = 0, attn_implementation: str = "eager"):
    """The PyTorch module in eval mode, with the fixed (ids, mask, segments) -> tuple signature."""
    import torch

    class EncoderOutputs(torch.nn.Module):
        """Fixes the signature to (input_ids, attention_mask, token_type_ids) -> tuple of tensors."""

        def __init__(self, model: torch.nn.Module):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return tuple(out[name] for name in ("last_hidden_state", "pooler_output") if out.get(name) is not None)

    if source.preset is not None:
        from transformers import BertModel

        config = _preset_config(source.preset)
        config._attn_implementation = attn_implementation
        torch.manual_seed(seed)
        model = BertModel(config)
    else:
        model = _from_directory(source, attn_implementation)
    return EncoderOutputs(model).to(getattr(torch, dtype)).eval()


def _from_directory(source: ModelSource, attn_implementation: str):
    """The model in a HuggingFace directory, or an InputError: everything read here is the user's
    files (truncated or garbage weights, weights of other shapes than config.json says)."""
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # its load report is a table; what matters in it is said below
    hf_logging.disable_progress_bar()
    try:
        model, info = AutoModel.from_pretrained(source.path, local_files_only=True, attn_implementation=attn_implementation,
                                                output_loading_info=True, ignore_mismatched_sizes=True)
    except Exception as exc:  # noqa: BLE001 - safetensors, pickle, torch and transformers each raise their own
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        raise InputError(f"cannot load the model in '{source.name}': {type(exc).__name__}: {first[:200]}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    mismatched = sorted(info["mismatched_keys"])
    if mismatched:
        key, stored, expected = mismatched[0]
        raise InputError(f"the weights in '{source.name}' do not match its config.json: {key} is {list(stored)} in the "
                         f"weight file and {list(expected)} by config.json ({len(mismatched)} weights differ)")
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        print(f"warning: '{source.name}' has no weights for {', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}: "
              "transformers initialized them at random", file=sys.stderr)
    return model


@dataclass(frozen=True)
class ExampleInputs:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        return (self.input_ids, self.attention_mask, self.token_type_ids)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)


def has_tokenizer(source: ModelSource) -> bool:
    return source.path is not None and any(
        (source.path / f).is_file() for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json")
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
    return ExampleInputs(ids, torch.ones(batch, seq_len, dtype=torch.long), segments)


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
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.path, local_files_only=True)
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
    return ExampleInputs(rows(ids), rows(mask), rows(segments))
