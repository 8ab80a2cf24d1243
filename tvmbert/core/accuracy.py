"""What a user of each head compares between a build and fp32 PyTorch, beyond the largest
difference: sentence embeddings by their cosine and by how they rank each other's similarity;
labels, tags and answer spans by agreement with fp32's choice. NumPy only. Each head kind
reduces one input's outputs to the rows its metrics compare (an embedding; a label, tag or span
with the margin fp32's scores chose it by), so that a caller keeps those, not every logit of every input."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

# Fewer rows than this give too few pairs for a rank correlation of their similarities to mean anything.
MIN_ROWS_FOR_SPEARMAN = 8


@dataclass
class Metric:
    name: str  # e.g. "cosine_min"
    value: float | None  # None: not computable on these inputs (too few rows)
    bar: float  # the least value that passes
    what: str  # in words, for the failure line

    @property
    def passed(self) -> bool:
        return self.value is None or self.value >= self.bar

    def to_json(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def mean_pooled(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Sentence embeddings as sentence-transformers makes them: the mean over real tokens."""
    weights = mask.astype(np.float64)[..., None]
    return (hidden.astype(np.float64) * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1.0)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row by row."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    norms = np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-30)
    return (a * b).sum(axis=-1) / norms


def _ranks(values: np.ndarray) -> np.ndarray:
    """Ranks from 0, ties sharing their mean rank."""
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = np.arange(len(values), dtype=np.float64)
    unique, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    if len(unique) < len(values):
        sums = np.bincount(inverse, weights=ranks)
        ranks = (sums / counts)[inverse]
    return ranks


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    rx, ry = _ranks(np.asarray(x, dtype=np.float64)), _ranks(np.asarray(y, dtype=np.float64))
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denominator = np.sqrt((rx * rx).sum() * (ry * ry).sum())
    return float((rx * ry).sum() / denominator) if denominator > 0 else 1.0


def pairwise_similarities(embeddings: np.ndarray) -> np.ndarray:
    """Cosine similarity of every pair of rows (the upper triangle): what semantic search ranks by."""
    unit = embeddings / np.maximum(np.linalg.norm(embeddings, axis=-1, keepdims=True), 1e-30)
    similarity = unit @ unit.T
    return similarity[np.triu_indices(len(embeddings), k=1)]


def embedding_metrics(got: np.ndarray, want: np.ndarray, bars: dict[str, float]) -> list[Metric]:
    """``got``/``want``: [rows, hidden] sentence embeddings of the same texts."""
    per_text = cosines(got, want)
    rank = spearman(pairwise_similarities(got), pairwise_similarities(want)) if len(got) >= MIN_ROWS_FOR_SPEARMAN else None
    return [
        Metric("cosine_min", float(per_text.min()), bars["cosine_min"], "the least cosine similarity of a text's embedding to fp32's"),
        Metric("cosine_mean", float(per_text.mean()), bars["cosine_mean"], "the mean cosine similarity of the embeddings to fp32's"),
        Metric("spearman", rank, bars["spearman"], "the Spearman correlation of the texts' pairwise similarities with fp32's"),
    ]


def best_spans(start: np.ndarray, end: np.ndarray, mask: np.ndarray, max_length: int = 30) -> np.ndarray:
    """[rows, 3]: the (start, end) with the highest start + end logit, start <= end < start +
    max_length, both on real tokens (the answer a QA pipeline returns), and the margin of its score
    over the next span's (inf where there is no other)."""
    real = mask.astype(bool)
    start = np.where(real, start.astype(np.float64), -np.inf)
    end = np.where(real, end.astype(np.float64), -np.inf)
    scores = start[:, :, None] + end[:, None, :]
    positions = np.arange(start.shape[1])
    allowed = (positions[None, :] >= positions[:, None]) & (positions[None, :] < positions[:, None] + max_length)
    scores = np.where(allowed[None], scores, -np.inf).reshape(len(start), -1)
    best = scores.argmax(axis=1)
    ordered = np.sort(scores, axis=1)
    with np.errstate(invalid="ignore"):  # no other span: the next scores -inf
        margin = np.nan_to_num(ordered[:, -1] - ordered[:, -2], nan=np.inf, posinf=np.inf) if scores.shape[1] > 1 else np.full(len(scores), np.inf)
    return np.stack([best // start.shape[1], best % start.shape[1], margin], axis=1)


def choices(logits: np.ndarray) -> np.ndarray:
    """[rows, 2]: each row's argmax and the margin of its top logit over the second (inf with one)."""
    logits = logits.astype(np.float64)
    top_two = np.sort(logits, axis=-1)[:, -2:] if logits.shape[-1] > 1 else None
    margin = top_two[:, 1] - top_two[:, 0] if top_two is not None else np.full(len(logits), np.inf)
    return np.stack([logits.argmax(axis=-1).astype(np.float64), margin], axis=1)


def _agreement(what: str, logits: int):
    def metrics(got: np.ndarray, want: np.ndarray, bars: dict[str, float], tie: float) -> list[Metric]:
        """``got``/``want``: rows of a choice, then the margin fp32 made it by (its last column).
        A choice fp32 makes by no more than ``tie`` could move it (each of the ``logits`` summed
        into a score moving that far, the runner-up's too) may go either way; every other counts."""
        same = (got[:, :-1] == want[:, :-1]).all(axis=1) | (want[:, -1] <= 2 * logits * tie)
        return [Metric("agreement", float(same.mean()) if len(want) else None, bars["agreement"], what)]

    return metrics


@dataclass(frozen=True)
class HeadKind:
    """What a head's users compare: ``rows`` reduces one input's outputs (and its attention mask)
    to the rows compared; ``metrics`` compares a build's rows with fp32's (bars by metric name,
    ``tie`` how far each logit may move without a changed choice counting: verify.agreement_tie)."""

    rows: Callable[[list[np.ndarray], np.ndarray], np.ndarray]
    metrics: Callable[[np.ndarray, np.ndarray, dict[str, float], float], list[Metric]]


# families.Task.accuracy names one of these.
HEAD_KINDS = {
    "embedding": HeadKind(lambda outputs, mask: mean_pooled(outputs[0], mask),
                          lambda got, want, bars, tie: embedding_metrics(got, want, bars)),
    "label": HeadKind(lambda outputs, mask: choices(outputs[0]), _agreement("the share of texts given fp32's label", 1)),
    "tag": HeadKind(lambda outputs, mask: choices(outputs[0][mask.astype(bool)]),
                    _agreement("the share of tokens given fp32's tag (or top-1 token)", 1)),
    "span": HeadKind(lambda outputs, mask: best_spans(outputs[0], outputs[1], mask),
                     _agreement("the share of questions given fp32's answer span", 2)),
    # A multiple-choice build scores one (question, choice) row each: an input's rows are taken
    # as one question's choices. An input of one row chooses nothing, and counts for nothing.
    "choice": HeadKind(lambda outputs, mask: choices(outputs[0].reshape(1, -1)) if outputs[0].size > 1 else np.empty((0, 2)),
                       _agreement("the share of questions given fp32's choice", 1)),
}
