"""Answers from per-token heads, computed as transformers' pipelines compute them, so that a user
swapping a pipeline for the server gets the same entities and spans: token classification
(``TokenClassificationPipeline``: a label per token, grouped into entities by their B-/I- tags)
and extractive question answering (``QuestionAnsweringPipeline``: the likeliest span of context
tokens, over every window of a long context)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

AGGREGATIONS = ("simple", "none")  # transformers' aggregation_strategy names this server takes
IGNORED_LABELS = ("O",)  # the pipelines' ignore_labels: "outside any entity"


def softmax(logits: np.ndarray) -> np.ndarray:
    """Over the last axis, in float64."""
    shifted = np.exp(np.asarray(logits, np.float64) - np.max(logits, axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def label_scores(logits: np.ndarray, raw: bool) -> np.ndarray:
    """A sequence classifier's scores as TEI gives them: a softmax over its labels, or a lone
    label's sigmoid (a cross-encoder's relevance: a softmax of one is always 1); ``raw``: the
    logits themselves."""
    logits = np.asarray(logits, np.float64)
    if raw:
        return logits
    if logits.shape[-1] != 1:
        return softmax(logits)
    small = np.exp(-np.abs(logits))  # the sigmoid from the side where it neither overflows nor cancels
    return np.where(logits >= 0, 1 / (1 + small), small / (1 + small))


def best_first(scores: np.ndarray) -> np.ndarray:
    """Indices by score, highest first, as TEI orders them (ascending, then reversed: of equal
    scores, the later first)."""
    return np.argsort(scores, kind="stable")[::-1]


def _tag(label: str) -> tuple[str, str]:
    """(B or I, the entity type) of a label; a label outside the B-/I- scheme is an I of itself."""
    if label.startswith(("B-", "I-")):
        return label[0], label[2:]
    return "I", label


def token_entities(text: str, encoding, logits: np.ndarray, labels: list[str], aggregation: str, words, unknown_id) -> list[dict]:
    """One text's entities. ``none``: every real token not labelled O, with its label, score,
    index, token (the text itself where the tokenizer had none for it) and character span.
    ``simple``: consecutive tokens of one entity type (a B- tag starts a new one) grouped, their
    mean score, their tokens joined by ``words`` (the tokenizer's decoder, as the pipeline joins
    them)."""
    scores = softmax(logits)
    tokens = []
    for index, (special, (start, end)) in enumerate(zip(encoding.special_tokens_mask, encoding.offsets)):
        if special:
            continue
        best = int(np.argmax(scores[index]))
        word = text[start:end] if encoding.ids[index] == unknown_id else encoding.tokens[index]
        tokens.append({"entity": labels[best], "score": float(scores[index, best]), "index": index,
                       "word": word, "start": int(start), "end": int(end)})
    if aggregation == "none":
        return [token for token in tokens if token["entity"] not in IGNORED_LABELS]
    groups: list[list[dict]] = []
    for token in tokens:
        kind, name = _tag(token["entity"])
        if groups and kind != "B" and _tag(groups[-1][-1]["entity"])[1] == name:
            groups[-1].append(token)
        else:
            groups.append([token])
    entities = []
    for group in groups:
        name = group[0]["entity"].split("-", 1)[-1]
        if name in IGNORED_LABELS:
            continue
        start, end = group[0]["start"], group[-1]["end"]
        entities.append({"entity_group": name, "score": float(np.mean([t["score"] for t in group])),
                         "word": words([t["word"] for t in group]), "start": start, "end": end})
    return entities


@dataclass(frozen=True)
class Span:
    score: float
    start: int  # characters into the context
    end: int


def _characters(encoding, first: int, last: int, align_to_words: bool) -> tuple[int, int]:
    """Where tokens ``first`` to ``last`` lie in the context; widened to whole words with
    ``align_to_words`` (an answer starting at "##wee" starts at "tweety")."""
    if align_to_words:
        first_word, last_word = encoding.token_to_word(first), encoding.token_to_word(last)
        starts = encoding.word_to_chars(first_word, 1) if first_word is not None else None
        ends = encoding.word_to_chars(last_word, 1) if last_word is not None else None
        if starts is not None and ends is not None:
            return starts[0], ends[1]
    return encoding.offsets[first][0], encoding.offsets[last][1]


def window_spans(encoding, start_logits: np.ndarray, end_logits: np.ndarray, top_k: int, max_answer_len: int,
                 align_to_words: bool = True) -> list[Span]:
    """The ``top_k`` likeliest answers in one window (question, then a stretch of the context):
    each start and end probability a softmax over the context's tokens and the first token,
    whose own probability then counts for nothing; a span starts and ends in the context, ends
    no earlier than it starts, and holds at most ``max_answer_len`` tokens; its score is the
    product of its start's and its end's probabilities."""
    allowed = np.array([sequence == 1 for sequence in encoding.sequence_ids])
    allowed[0] = True  # the first token ([CLS]) stays in the softmax, as the pipeline keeps it
    starts = softmax(np.where(allowed, start_logits, -10000.0))
    ends = softmax(np.where(allowed, end_logits, -10000.0))
    starts[0] = ends[0] = 0.0
    candidates = np.tril(np.triu(np.outer(starts, ends)), max_answer_len - 1)
    flat = candidates.ravel()
    order = np.argsort(-flat, kind="stable")[:top_k]
    spans = []
    for first, last in zip(*np.unravel_index(order, candidates.shape)):
        if allowed[first] and allowed[last] and first > 0 and last > 0:
            start, end = _characters(encoding, int(first), int(last), align_to_words)
            spans.append(Span(float(candidates[first, last]), int(start), int(end)))
    return spans


def answers(context: str, windows: list, start_logits: list[np.ndarray], end_logits: list[np.ndarray], top_k: int,
            max_answer_len: int, align_to_words: bool = True) -> list[dict]:
    """The ``top_k`` likeliest answers over every window of one context, best first."""
    spans = [span for encoding, starts, ends in zip(windows, start_logits, end_logits)
             for span in window_spans(encoding, starts, ends, top_k, max_answer_len, align_to_words)]
    spans.sort(key=lambda span: -span.score)
    return [{"score": s.score, "start": s.start, "end": s.end, "answer": context[s.start:s.end]} for s in spans[:top_k]]
