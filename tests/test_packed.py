"""Packed builds (--tokens, export --packed, bench --packed): a batch's real tokens as one stream,
attention per sequence; the same outputs as the padded model on the real tokens."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tvmbert import InputError, Job, JobConfig, build, load
from tvmbert.deploy import packing
from tvmbert.deploy.compiled import CompiledModel
from tvmbert.frontend import models
from tvmbert.stages.export import export

from helpers import HOST_LANES, QKV_PANEL, assert_one_line_error, run_without_torch

BATCH, SEQ_LEN, TOKENS = 4, 16, 32


def mixed_rows(inputs: int, lengths=(SEQ_LEN, 1, 9, 5), width: int = SEQ_LEN, seed: int = 0, vocab: int = 30522):
    """Rows of the given lengths padded to ``width``, an interior token of row 2 masked."""
    rng = np.random.default_rng(seed)
    mask = (np.arange(width)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    if len(lengths) > 2:
        mask[2, 3] = 0
    ids = rng.integers(vocab // 30, vocab, (len(lengths), width)) * (np.arange(width)[None, :] < np.array(lengths)[:, None])
    segments = rng.integers(0, 2, ids.shape) * mask
    return [ids, mask, segments][:inputs]


def pytorch(source, arrays, dtype: str = "float32"):
    import torch

    with torch.no_grad():
        return [t.numpy() for t in models.load(source, dtype)(*(torch.from_numpy(a) for a in arrays))]


def assert_equal_on_real_tokens(got, want, lengths, per_token, tolerance: float = 1e-4):
    real = np.arange(got[0].shape[1])[None, :] < np.array(lengths)[:, None]
    for have, expected, token_rows in zip(got, want, per_token):
        assert have.shape == expected.shape
        if token_rows:
            assert np.abs(have[real] - expected[real]).max() < tolerance
            assert not have[~real].any()  # zeros past each row's length
        else:
            assert np.abs(have - expected).max() < tolerance


@pytest.mark.parametrize("model", ["bert-tiny", "distilbert-tiny"])
def test_a_packed_build_equals_the_padded_pytorch_model_on_the_real_tokens(workdir, model):
    """Mixed lengths with a full row and a row of one token, 31 of 32 tokens: bert-tiny's three
    inputs and pooler, DistilBERT's two inputs and no token types."""
    job = Job(JobConfig(model=model, batch=BATCH, seq_len=SEQ_LEN, tokens=TOKENS, workdir=str(workdir)))
    built = build(job)
    assert built.path.parts[-3] == f"b{BATCH}-s{SEQ_LEN}-t{TOKENS}-float32"
    assert sorted(built.meta["packing"]) == ["batch", "positions", "seq_len", "tokens"]  # (a cached stage.json reads them sorted)
    kernels = built.meta.get("attention_kernels", [])
    if model == "bert-tiny" and HOST_LANES:  # our kernel, packed rows, Q/K/V panels
        assert kernels == [f"attention_{BATCH}x2x{SEQ_LEN}x64_masked_packed{TOKENS}_panels{QKV_PANEL}"], kernels
    compiled = CompiledModel(built, job)
    arrays = mixed_rows(len(job.source.inputs))
    got = compiled(arrays)
    assert_equal_on_real_tokens(got, pytorch(job.source, arrays), [SEQ_LEN, 1, 9, 5], compiled.per_token)
    assert len(got) == (2 if model == "bert-tiny" else 1)
    with pytest.raises(InputError, match="takes at most 32"):
        compiled(mixed_rows(len(job.source.inputs), lengths=(SEQ_LEN, SEQ_LEN, SEQ_LEN, 1)))
    whole = mixed_rows(len(job.source.inputs), lengths=(4, 1, 5, 5))  # row 1 then counts 16 tokens: 30 in all
    whole[1][1] = 0
    with pytest.raises(InputError, match="row 1 is masked whole"):
        compiled(whole)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_packed_modernbert_attends_within_each_sequence_and_its_window(workdir, dtype):
    """ModernBERT was made for unpadded batches: rotary positions counted from each row's start,
    its global layers over the row's keys, its local ones over those within the window (4 either
    side in the tiny preset: at 16 tokens it cuts), the window computed by the attention kernel in
    the packed grid; the padded model's outputs on the real tokens, fp64 to 1e-10."""
    job = Job(JobConfig(model="modernbert-tiny", batch=BATCH, seq_len=SEQ_LEN, tokens=TOKENS, dtype=dtype, workdir=str(workdir)))
    built = build(job)
    if dtype == "float32" and HOST_LANES:
        assert sorted(built.meta["attention_kernels"]) == [f"attention_{BATCH}x2x{SEQ_LEN}x32_masked_packed{TOKENS}",
                                                           f"attention_{BATCH}x2x{SEQ_LEN}x32_masked_window4_packed{TOKENS}"]
        optimized = (workdir / "modernbert-tiny" / f"b{BATCH}-s{SEQ_LEN}-t{TOKENS}-float32" / "optimize" / "module.py").read_text()
        assert f"R.Tensor(({BATCH}, 1, {SEQ_LEN}, {SEQ_LEN})" not in optimized  # the window is the kernel's, no mask of it
    compiled = CompiledModel(built, job)
    arrays = mixed_rows(len(job.source.inputs), vocab=job.source.vocab_size)
    assert_equal_on_real_tokens(compiled(arrays), pytorch(job.source, arrays, dtype), [SEQ_LEN, 1, 9, 5], compiled.per_token,
                                1e-4 if dtype == "float32" else 1e-10)


def test_roberta_positions_count_the_non_pad_tokens_as_transformers_does():
    import torch
    from transformers.models.roberta.modeling_roberta import RobertaEmbeddings

    ids = np.array([[0, 5, 1, 7, 8], [0, 9, 2, 1, 1]])
    rows = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    packed = packing.pack(rows, [5, 3], 2, 5, 10, {"rule": "non-pad-count", "pad": 1})
    want = RobertaEmbeddings.create_position_ids_from_input_ids(torch.from_numpy(ids), 1).numpy()
    assert packed["position_ids"].tolist() == [*want[0], *want[1, :3], 0, 0]  # then two stream tokens past the rows
    assert packed["gather_index"][1].tolist() == [5, 6, 7, 0, 0] and packed["key_mask"][1].tolist() == [1, 1, 1, 0, 0]
    assert packed["token_slot"][:8].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]


@pytest.mark.slow
def test_a_packed_export_serves_mixed_batches_without_torch(workdir, tmp_path):
    """Buckets 1x16, 4x16 and 4x16 packed to 16 and 32 tokens; batches of mixed lengths (and a
    row masked whole, which only a padded bucket serves) through tvmbert.load where torch
    cannot be imported, against PyTorch on the real tokens."""
    out = tmp_path / "packed"
    manifest = export(JobConfig(model="bert-tiny", workdir=str(workdir)), out, batches=(1, BATCH), seq_lens=(SEQ_LEN,), packed=True)
    assert manifest["format"] == 2 and manifest["packing"]["positions"] == {"rule": "index", "pad": 0}
    assert [(b["batch"], b.get("tokens")) for b in manifest["buckets"]] == [(1, None), (4, None), (4, 16), (4, 32)]
    assert "lib/b4-s16-t32.so" in manifest["files"]
    model = load(out)
    # The planner weighs buckets by their latency measured at export; bert-tiny's are too small
    # to tell apart reliably, so here each costs its token capacity plus a fixed 4 per run.
    model.buckets = [replace(b, cost_ms=b.capacity + 4.0) for b in model.buckets]
    assert [model.buckets[index].tokens for index, _ in model.plan([16, 1, 9, 5])] == [32]
    plan = model.plan([16, 1, 9, 5], [True, False, True, True])  # row 1 masked whole: a padded bucket's
    assert [(model.buckets[index].tokens, rows) for index, rows in plan] == [(32, [0, 2, 3]), (None, [1])]
    assert [model.buckets[index].tokens for index, _ in model.plan([3, 2, 1, 1])] == [16]
    cases = [mixed_rows(3, lengths, max(lengths), seed) for seed, lengths in enumerate([(16, 1, 9, 5), (3, 2), (16, 16, 1), (7,) * 6])]
    cases[2][1][2] = 0  # row 2 masked whole: planned onto a padded bucket
    np.savez(tmp_path / "inputs.npz", *[a for case in cases for a in case])
    run_without_torch("""
from dataclasses import replace
import numpy as np, tvmbert
model = tvmbert.load(sys.argv[1])
model.buckets = [replace(b, cost_ms=b.capacity + 4.0) for b in model.buckets]
arrays = np.load(sys.argv[2])
arrays = [arrays[f"arr_{i}"] for i in range(len(arrays.files))]
outputs = {}
for case in range(len(arrays) // 3):
    result = model(*arrays[3 * case: 3 * case + 3])
    outputs[f"hidden{case}"], outputs[f"pooled{case}"] = result["last_hidden_state"], result["pooler_output"]
np.savez(sys.argv[3], **outputs)
""", str(out), str(tmp_path / "inputs.npz"), str(tmp_path / "outputs.npz"))
    outputs = np.load(tmp_path / "outputs.npz")
    source = models.resolve("bert-tiny")
    for case, arrays in enumerate(cases):
        lengths = packing.lengths(arrays[1], arrays[1].shape)
        got = [outputs[f"hidden{case}"], outputs[f"pooled{case}"]]
        assert_equal_on_real_tokens(got, pytorch(source, arrays), lengths, [True, False])


def test_bench_packed_times_the_packed_build_against_the_padded_one(tvmbert):
    result = tvmbert("bench", "bert-tiny", "--batch", str(BATCH), "--seq-len", str(SEQ_LEN), "--padding", "0.5", "--engines", "tvm",
                     "--packed", "--warmup", "0", "--repeat", "3", "--min-time", "0", "--json")
    assert result.code == 0, result.stderr
    report = result.json
    assert set(report["engines"]) == {"tvm", "tvm-packed"} and report["packed_speedup"] > 0
    assert report["best_other"] is None  # the packed build is not a peer


def test_what_packed_builds_do_not_serve_is_refused(tvmbert, tmp_path):
    assert_one_line_error(tvmbert("build", "bert-tiny", "--task", "text-classification", "--batch", "2", "--tokens", "8"),
                          "packed build of text-classification is not supported")
    assert_one_line_error(tvmbert("build", "bert-tiny", "--batch", "2", "--seq-len", "8", "--tokens", "17"), "above batch x seq-len")
    assert_one_line_error(tvmbert("build", "bert-tiny", "--batch", "4", "--seq-len", "8", "--tokens", "3"), "'tokens' must be a number >= batch")
    assert_one_line_error(tvmbert("export", "bert-tiny", "--task", "text-classification", "--packed", "-o", str(tmp_path / "p")),
                          "--packed: text-classification has no packed builds")
    config = tmp_path / "packed.yaml"
    config.write_text("model: bert-tiny\nexport: {packed: yes please}\n")
    assert_one_line_error(tvmbert("export", "--config", str(config), "-o", str(tmp_path / "p")), "export.packed")
    assert not (tmp_path / "p").exists()
