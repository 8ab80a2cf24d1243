"""Every family with every head, saved as users save them, through verify in fp32 and fp64;
then the config settings of ModernBERT and DeBERTa-v2 that their checkpoints vary.

    python benchmarks/family_matrix.py [FOLDER]

Writes a small random-weight directory per (family, task), and per entry of ``VARIANTS``, with
``save_pretrained`` under FOLDER (default: a temporary one), verifies each against PyTorch, and
prints one line per check and the worst difference per dtype. Exit 1 if any check fails.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import transformers

from tvmbert import Job, JobConfig, verify
from tvmbert.core.families import FAMILIES, TASKS

SMALL = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=40)
DISTILBERT_SMALL = dict(vocab_size=300, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=40)


def config_for(family: str, task: str) -> dict:
    config = dict(DISTILBERT_SMALL if family == "distilbert" else SMALL)
    if family in ("albert", "electra"):
        config["embedding_size"] = 16
    if family in ("roberta", "xlm-roberta", "camembert"):
        config.update(max_position_embeddings=42, pad_token_id=1)  # positions start after the pad id
    if family == "deberta-v2":  # as microsoft/deberta-v3-* set it: disentangled attention over 2 x 16 buckets
        config.update(relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=16, max_relative_positions=-1,
                      share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False, type_vocab_size=0)
    if family == "modernbert":  # a global layer and a local one whose window (8 tokens) the example exceeds
        config.update(local_attention=8, pad_token_id=0)
    config["num_labels"] = 2 if task == "question-answering" else 3
    return config


# (name, transformers class, settings over config_for's): what released checkpoints and their
# fine-tunes set differently from the presets.
VARIANTS = (
    ("modernbert mean pooling", "ModernBertForSequenceClassification", dict(classifier_pooling="mean")),
    ("modernbert biases", "ModernBertForSequenceClassification",
     dict(norm_bias=True, attention_bias=True, mlp_bias=True, classifier_bias=True, decoder_bias=True)),
    ("modernbert silu, tanh head", "ModernBertForTokenClassification", dict(hidden_activation="silu", classifier_activation="tanh")),
    ("modernbert global every 2", "ModernBertForMaskedLM", dict(num_hidden_layers=4, global_attn_every_n_layers=2,
                                                                tie_word_embeddings=False)),
    ("modernbert 4 heads, thetas", "ModernBertForQuestionAnswering", dict(hidden_size=64, num_attention_heads=4, local_attention=16,
                                                                          global_rope_theta=10000.0, local_rope_theta=500.0)),
    ("modernbert heads of 64", "ModernBertForTokenClassification", dict(hidden_size=128, local_attention=16)),
    ("deberta c2p only", "DebertaV2ForSequenceClassification", dict(pos_att_type=["c2p"])),
    ("deberta p2c only", "DebertaV2ForTokenClassification", dict(pos_att_type=["p2c"])),
    ("deberta types as a string", "DebertaV2Model", dict(pos_att_type="p2c|c2p")),
    ("deberta no buckets", "DebertaV2ForQuestionAnswering", dict(position_buckets=-1, max_relative_positions=24)),
    ("deberta unshared keys", "DebertaV2ForMaskedLM", dict(share_att_key=False)),
    ("deberta no norm_rel_ebd", "DebertaV2Model", dict(norm_rel_ebd="none")),
    ("deberta segment ids", "DebertaV2ForSequenceClassification", dict(type_vocab_size=2)),
    ("deberta embedding_size", "DebertaV2ForTokenClassification", dict(embedding_size=16)),
    ("deberta absolute positions too", "DebertaV2Model", dict(position_biased_input=True)),
    ("deberta no relative attention", "DebertaV2ForSequenceClassification", dict(relative_attention=False,
                                                                                 position_biased_input=True)),
    ("deberta-v2 convolution", "DebertaV2Model", dict(conv_kernel_size=3, conv_act="gelu")),
    ("deberta gelu_new", "DebertaV2ForSequenceClassification", dict(hidden_act="gelu_new", pooler_hidden_act="tanh")),
)


def main(folder: Path) -> int:
    worst = {"float32": 0.0, "float64": 0.0}
    failed = 0

    def check(name: str, model_class, config: dict) -> None:
        nonlocal failed
        directory = folder / name.replace(" ", "-")
        torch.manual_seed(1)
        model_class(model_class.config_class(**config)).save_pretrained(directory)
        for dtype in worst:
            job = Job(JobConfig(model=str(directory), dtype=dtype, workdir=str(folder / "work")), say=lambda message: None)
            result = verify(job)
            worst[dtype] = max(worst[dtype], result.max_abs_diff)
            failed += not result.passed
            print(f"{name:35} {dtype}: {'PASSED' if result.passed else 'FAILED'} "
                  f"{result.max_abs_diff:.2g} {[o.name for o in result.outputs]}", flush=True)

    for family_name, family in FAMILIES.items():
        for task_name, task in TASKS.items():
            check(f"{family_name} {task_name}", getattr(transformers, family.model_prefix + task.class_suffix),
                  config_for(family_name, task_name))
    for name, class_name, settings in VARIANTS:
        model_class = getattr(transformers, class_name)
        family = next(f for f, entry in FAMILIES.items() if class_name.startswith(entry.model_prefix))
        task = next(t for t, entry in TASKS.items() if class_name == FAMILIES[family].model_prefix + entry.class_suffix)
        check(name, model_class, {**config_for(family, task), **settings})
    print(f"worst: {worst}; {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as scratch:
        sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(scratch)))
