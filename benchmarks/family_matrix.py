"""Every family with every head, saved as users save them, through verify in fp32 and fp64.

    python benchmarks/family_matrix.py [FOLDER]

Writes a small random-weight directory per (family, task) with ``save_pretrained`` under FOLDER
(default: a temporary one), verifies each against PyTorch, and prints one line per check and the
worst difference per dtype. Exit 1 if any check fails.
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


def main(folder: Path) -> int:
    worst = {"float32": 0.0, "float64": 0.0}
    failed = 0
    for family_name, family in FAMILIES.items():
        for task_name, task in TASKS.items():
            model_class = getattr(transformers, family.model_prefix + task.class_suffix)
            directory = folder / f"{family_name}-{task_name}"
            torch.manual_seed(1)
            model_class(model_class.config_class(**config_for(family_name, task_name))).save_pretrained(directory)
            for dtype in worst:
                job = Job(JobConfig(model=str(directory), dtype=dtype, workdir=str(folder / "work")), say=lambda message: None)
                result = verify(job)
                worst[dtype] = max(worst[dtype], result.max_abs_diff)
                failed += not result.passed
                print(f"{family_name:12} {task_name:22} {dtype}: {'PASSED' if result.passed else 'FAILED'} "
                      f"{result.max_abs_diff:.2g} {[o.name for o in result.outputs]}", flush=True)
    print(f"worst: {worst}; {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as scratch:
        sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(scratch)))
