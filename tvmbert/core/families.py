"""The model families and tasks tvmbert compiles: one table each, so that adding one is one entry.

A family is what ``config.json`` calls ``model_type``: the inputs its models take, where its
encoder layers live, and how its sizes are spelled. A task is a head on top of the encoder,
named as optimum and ONNX Runtime's exporters name it, with the outputs HF gives it. Nothing
here imports transformers or torch: the classes are named, and looked up when a model is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

BERT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def _encoder_layers(base):
    return base.encoder.layer


def _pooler(base, first_tokens):
    """BERT's pooler on each sequence's first token ([sequences, hidden]; it reads [:, 0])."""
    return base.pooler(first_tokens[:, None])


@dataclass(frozen=True)
class Family:
    """What tvmbert needs to know of one ``model_type``."""

    config_class: str  # transformers' config class, for presets
    model_prefix: str  # transformers' model classes are this + "Model", + "ForSequenceClassification", ...
    inputs: tuple[str, ...] = BERT_INPUTS  # a prefix of BERT_INPUTS: models.load's signature
    # The list of encoder layers in the base model (``model.base_model``); layer 0 is what
    # ``add_tvm_dispatch``, ``verify --train`` and ``bench --train`` compile. ALBERT's one shared
    # layer is called by every position in the stack.
    layers: Callable = _encoder_layers
    # Keyword names of the architecture sizes in this family's config class (presets).
    size_names: dict[str, str] = field(default_factory=dict)
    # Packed builds (packing.py): how the model numbers positions from a row's ids (a
    # packing.POSITIONS key), and its pooler applied to each sequence's first token.
    positions: str = "index"
    pool: Callable = _pooler
    # The attention mask a packed build gives the model (frontend/packed_attention.py), from the
    # [batch, seq_len] grid's keys that count.
    packed_mask: Callable = lambda config, key_mask, dtype: _additive_key_mask(key_mask, dtype)
    # Why packed builds refuse this family, where they do: its attention is not the one
    # packed_attention.py replaces per sequence.
    not_packable: str = ""
    # Why ``verify --train`` and ``bench --train`` cannot compile its layer 0 alone, where they
    # cannot: they call it with the hidden states and the additive mask only.
    layer_not_alone: str = ""
    # What the model computes from positions alone, made a table at load (a
    # frontend/exact.POSITION_TABLES key; "" for none).
    position_tables: str = ""
    # Its eager attention takes the softmax in float32 whatever the model's dtype: float64 models
    # load with frontend/exact.FLOAT64_ATTENTION.
    softmax_in_float32: bool = False
    # Our kernels its graph does not take, each with why (build names them): those layers run the
    # graph path, compiled and tuned as any other TVM graph.
    kernels_not_applied: dict[str, str] = field(default_factory=dict)
    # The keys each layer's queries attend to, from its config: None for every key, else a local
    # window's width (what bench's FLOPs and floor count: a local layer computes no more).
    attention_keys: Callable = lambda config: (None,) * config.num_hidden_layers


def _additive_key_mask(key_mask, dtype):
    """[batch, 1, 1, seq_len]: 0 at a key that counts, the dtype's minimum at one that does not."""
    import torch

    return ((1.0 - key_mask.to(dtype)) * torch.finfo(dtype).min)[:, None, None, :]


def _modernbert_reach(config) -> int:
    """How many positions either side of its query a ModernBERT local layer's keys lie:
    ``local_attention // 2`` (transformers' window mask, ``|i - j| <= sliding_window``)."""
    return config.local_attention // 2


def _modernbert_packed_masks(config, key_mask, dtype) -> dict:
    """Its model takes a mask per layer type: the key mask for its global layers, and for its
    local ones the keys that count within its reach of the query, in the form its padded masks
    take (``where(keys & |i - j| <= w, 0, min)``), from which the attention kernel computes only
    the window's scores."""
    import torch

    seq_len = key_mask.shape[1]
    positions = torch.arange(seq_len)
    window = (positions.view(1, 1, seq_len, 1) - positions.view(1, 1, 1, seq_len)).abs() <= _modernbert_reach(config)
    local = torch.where(key_mask.bool()[:, None, None, :] & window, torch.tensor(0.0, dtype=dtype), torch.finfo(dtype).min)
    return {"full_attention": _additive_key_mask(key_mask, dtype), "sliding_attention": local}


def _modernbert_keys(config) -> tuple[int | None, ...]:
    """Its ``full_attention`` layers see every key; its ``sliding_attention`` ones those within
    its reach either side."""
    return tuple(None if kind == "full_attention" else 2 * _modernbert_reach(config) + 1 for kind in config.layer_types)


FAMILIES: dict[str, Family] = {
    "bert": Family("BertConfig", "Bert"),
    # Positions count the non-pad tokens from pad + 1 (create_position_ids_from_input_ids).
    "roberta": Family("RobertaConfig", "Roberta", positions="non-pad-count"),
    "xlm-roberta": Family("XLMRobertaConfig", "XLMRoberta", positions="non-pad-count"),
    "camembert": Family("CamembertConfig", "Camembert", positions="non-pad-count"),
    "electra": Family("ElectraConfig", "Electra"),
    # No segment ids; its sizes are spelled dim / n_layers / n_heads / hidden_dim.
    "distilbert": Family("DistilBertConfig", "DistilBert", inputs=("input_ids", "attention_mask"),
                         layers=lambda base: base.transformer.layer,
                         size_names={"num_hidden_layers": "n_layers", "hidden_size": "dim",
                                     "num_attention_heads": "n_heads", "intermediate_size": "hidden_dim"}),
    # Factorized embeddings (embedding_size < hidden_size) and one layer's weights for all layers.
    # Its pooler is a bare Linear, with the tanh apart.
    "albert": Family("AlbertConfig", "Albert", layers=lambda base: base.encoder.albert_layer_groups[0].albert_layers,
                     pool=lambda base, first_tokens: base.pooler_activation(base.pooler(first_tokens))),
    # Pre-norm layers without biases, GeGLU, rotary positions, and a local attention (a window of
    # local_attention tokens) in two layers of three. No segment ids, no pooler.
    "modernbert": Family("ModernBertConfig", "ModernBert", inputs=("input_ids", "attention_mask"),
                         layers=lambda base: base.layers, position_tables="rotary", softmax_in_float32=True,
                         attention_keys=_modernbert_keys, packed_mask=_modernbert_packed_masks,
                         layer_not_alone="its layers take the rotary cos/sin and a per-layer-type mask as well"),
    # DeBERTa-v3's model_type. Disentangled attention: content-to-position and position-to-content
    # scores from relative-position buckets. v3 configs have type_vocab_size 0: no segment ids.
    "deberta-v2": Family("DebertaV2Config", "DebertaV2", position_tables="relative-buckets",
                         not_packable="its disentangled attention is not the one packed builds replace",
                         layer_not_alone="its layers take the relative positions and their embeddings as well"),
}


@dataclass(frozen=True)
class Task:
    """A head: the transformers class suffix that builds it and the outputs it returns, in order."""

    class_suffix: str
    outputs: tuple[str, ...]
    per_token: tuple[str, ...]  # outputs with one row per token: compared on real tokens only
    fixed_labels: int | None = None  # QA heads have exactly two (start, end), whatever config says
    packable: bool = True  # its head works token by token (or is the pooler): a packed build can run it
    accuracy: str = "tag"  # what its users compare: a core/accuracy.HEAD_KINDS key
    # The head takes [questions, choices, tokens] and scores each choice. Builds score rows: one
    # (question, choice) pair each, given to the head as [rows, 1, tokens], logits [rows, 1];
    # tvmbert.load takes the three-dimensional inputs and gives [questions, choices] back.
    choice_rows: bool = False


TASKS: dict[str, Task] = {
    "feature-extraction": Task("Model", ("last_hidden_state", "pooler_output"), per_token=("last_hidden_state",),
                               accuracy="embedding"),
    # Each family's classifier reads the first token inside the model, of a [batch, tokens] layout.
    "text-classification": Task("ForSequenceClassification", ("logits",), per_token=(), packable=False,
                                accuracy="label"),
    "token-classification": Task("ForTokenClassification", ("logits",), per_token=("logits",)),
    "question-answering": Task("ForQuestionAnswering", ("start_logits", "end_logits"),
                               per_token=("start_logits", "end_logits"), fixed_labels=2, accuracy="span"),
    "fill-mask": Task("ForMaskedLM", ("logits",), per_token=("logits",)),
    # Its classifier reads each row's first token (or pools the row, ModernBERT's "mean"): no packed build.
    "multiple-choice": Task("ForMultipleChoice", ("logits",), per_token=(), packable=False, accuracy="choice",
                            choice_rows=True),
}
DEFAULT_TASK = "feature-extraction"


def task_of_architecture(architecture: str, family: Family) -> str | None:
    """The task a ``config.json`` architecture name stands for, or None when tvmbert has no such head."""
    for name, task in TASKS.items():
        if architecture == family.model_prefix + task.class_suffix:
            return name
    return None


@dataclass(frozen=True)
class Preset:
    """A model built from a config and a seed: no files, no download."""

    family: str
    sizes: dict  # num_hidden_layers, hidden_size, num_attention_heads, intermediate_size (+ family extras)
    vocab_size: int = 30522
    max_positions: int = 512
    type_vocab_size: int = 2  # 0: the family's embeddings have no segment ids (DeBERTa-v3)


# DeBERTa-v3's attention, as microsoft/deberta-v3-* configs set it (position_buckets apart).
DEBERTA_V3 = dict(relative_attention=True, norm_rel_ebd="layer_norm", share_att_key=True, pos_att_type=["p2c", "c2p"],
                  position_biased_input=False, max_relative_positions=-1, layer_norm_eps=1e-7)

PRESETS: dict[str, Preset] = {
    "bert-tiny": Preset("bert", dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=512)),
    "bert-mini": Preset("bert", dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024)),
    "bert-base": Preset("bert", dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072)),
    "bert-large": Preset("bert", dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, intermediate_size=4096)),
    # distilbert-base-uncased and albert-base-v2's architectures.
    "distilbert-tiny": Preset("distilbert", dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=512)),
    "distilbert-base": Preset("distilbert", dict(num_hidden_layers=6, hidden_size=768, num_attention_heads=12, intermediate_size=3072)),
    "albert-tiny": Preset("albert", dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=512,
                                         embedding_size=64), vocab_size=30000),
    "albert-base": Preset("albert", dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                                         embedding_size=128), vocab_size=30000),
    # answerdotai/ModernBERT-base's architecture; the tiny one keeps a global and a local layer, with
    # a window (8 tokens) below the tests' sequences.
    "modernbert-tiny": Preset("modernbert", dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=96,
                                                 local_attention=8, pad_token_id=0, bos_token_id=1, cls_token_id=1, eos_token_id=2,
                                                 sep_token_id=2), vocab_size=1000),
    "modernbert-base": Preset("modernbert", dict(num_hidden_layers=22, hidden_size=768, num_attention_heads=12,
                                                 intermediate_size=1152), vocab_size=50368, max_positions=8192),
    # microsoft/deberta-v3-base's architecture; the tiny one with 8 position buckets, so that the
    # tests' sequences reach its log-scaled buckets.
    "deberta-v3-tiny": Preset("deberta-v2", dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128,
                                                 **DEBERTA_V3, position_buckets=8), vocab_size=1000, type_vocab_size=0),
    "deberta-v3-base": Preset("deberta-v2", dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                                                 **DEBERTA_V3, position_buckets=256), vocab_size=128100, type_vocab_size=0),
}


def preset_config_kwargs(preset: Preset) -> dict:
    """The preset's sizes under the names its family's config class uses."""
    names = FAMILIES[preset.family].size_names
    return {names.get(key, key): value for key, value in preset.sizes.items()}
