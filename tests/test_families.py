"""Model families and task heads: directories as users save them, through every stage."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tvmbert.core.errors import InputError
from tvmbert.core.families import DEBERTA_V3, FAMILIES, PRESETS, TASKS
from tvmbert.frontend import models

from helpers import HOST_AMX, HOST_AMX_INT8, HOST_INT8_ATTENTION, HOST_LANES, HOST_TARGET, WITHOUT_KERNELS, assert_one_line_error

SMALL = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=40)
DISTILBERT_SMALL = dict(vocab_size=300, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=40)
# A global and a local layer, its window (8) below the samples' lengths; special tokens in the vocabulary.
MODERNBERT_SMALL = dict(SMALL, intermediate_size=48, local_attention=8, pad_token_id=0, bos_token_id=1, cls_token_id=1,
                        eos_token_id=2, sep_token_id=2)
DEBERTA_V3_SMALL = dict(SMALL, **DEBERTA_V3, position_buckets=8, type_vocab_size=0)


def _save(folder, class_name: str, **config) -> str:
    """A fine-tuned-shaped directory: random weights of ``class_name``, saved as HF saves them."""
    import transformers

    model_class = getattr(transformers, class_name)
    torch.manual_seed(5)
    model_class(model_class.config_class(**config)).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> directory, one per (family, head) the tests below compile."""
    made = {}
    for class_name, config in [
        ("BertForSequenceClassification", dict(SMALL, num_labels=3)),
        ("DistilBertForTokenClassification", dict(DISTILBERT_SMALL, num_labels=5)),
        ("AlbertForQuestionAnswering", dict(SMALL, embedding_size=16)),
        ("RobertaForMaskedLM", dict(SMALL, max_position_embeddings=42)),
        ("ElectraModel", dict(SMALL, embedding_size=16)),
        ("BertForPreTraining", SMALL),
        ("ModernBertForSequenceClassification", dict(MODERNBERT_SMALL, num_labels=3, classifier_pooling="mean")),
        ("DebertaV2ForQuestionAnswering", DEBERTA_V3_SMALL),
        ("AlbertForMultipleChoice", dict(SMALL, embedding_size=16)),
        ("ModernBertForMultipleChoice", dict(MODERNBERT_SMALL, classifier_pooling="cls")),
        ("DebertaV2ForMultipleChoice", DEBERTA_V3_SMALL),
    ]:
        made[class_name] = _save(tmp_path_factory.mktemp(class_name), class_name, **config)
    return made


@pytest.mark.parametrize("class_name, task, outputs", [
    ("BertForSequenceClassification", "text-classification", ["logits"]),
    ("DistilBertForTokenClassification", "token-classification", ["logits"]),
    ("AlbertForQuestionAnswering", "question-answering", ["start_logits", "end_logits"]),
    ("RobertaForMaskedLM", "fill-mask", ["logits"]),
    ("ElectraModel", "feature-extraction", ["last_hidden_state"]),  # ELECTRA has no pooler
    ("ModernBertForSequenceClassification", "text-classification", ["logits"]),
    ("DebertaV2ForQuestionAnswering", "question-answering", ["start_logits", "end_logits"]),
    ("AlbertForMultipleChoice", "multiple-choice", ["logits"]),
])
def test_task_is_inferred_from_architectures(saved, class_name, task, outputs):
    source = models.resolve(saved[class_name])
    assert source.task == task
    model = models.load(source)
    assert list(model.output_names) == outputs
    assert type(model.model).__name__ == class_name


def test_unsupported_head_is_refused_with_the_supported_ones(saved):
    with pytest.raises(InputError, match="BertForPreTraining, a head tvmbert does not compile; it compiles BertModel") as error:
        models.resolve(saved["BertForPreTraining"])
    assert "BertForQuestionAnswering (question-answering)" in str(error.value)
    # Asked for by name, the encoder alone is what the user wants.
    assert models.resolve(saved["BertForPreTraining"], task="feature-extraction").task == "feature-extraction"


def test_unknown_task_names_the_known_ones():
    with pytest.raises(InputError, match="unknown task 'text-clasification'.*did you mean text-classification"):
        models.resolve("bert-tiny", task="text-clasification")


def test_each_task_has_its_own_artifacts():
    plain, head = models.resolve("bert-tiny"), models.resolve("bert-tiny", task="text-classification")
    assert plain.key == "bert-tiny" and head.key == "bert-tiny-text-classification"
    assert plain.fingerprint != head.fingerprint


def test_distilbert_takes_no_segment_ids():
    source = models.resolve("distilbert-tiny")
    assert source.inputs == ("input_ids", "attention_mask")
    inputs = models.example_inputs(source, batch=2, seq_len=9, text=None)
    assert inputs.names == ("input_ids", "attention_mask") and inputs.shape == (2, 9)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_their_family(name):
    config = models.preset_config(name)
    preset = PRESETS[name]
    assert type(config).__name__ == FAMILIES[preset.family].config_class
    assert config.vocab_size == preset.vocab_size


def test_every_family_has_every_head():
    import transformers

    for family in FAMILIES.values():
        for task in TASKS.values():
            assert hasattr(transformers, family.model_prefix + task.class_suffix), (family.model_prefix, task.class_suffix)


@pytest.mark.parametrize("model, dtype, args", [
    ("BertForSequenceClassification", "float32", ()),
    ("DistilBertForTokenClassification", "float32", ()),
    ("AlbertForQuestionAnswering", "float64", ()),
    ("RobertaForMaskedLM", "float32", ("--batch", "2", "--seq-len", "11")),
    ("distilbert-tiny", "float64", ()),
    ("albert-tiny", "float32", ("--task", "text-classification")),
    ("ModernBertForSequenceClassification", "float64", ("--seq-len", "20")),
    ("DebertaV2ForQuestionAnswering", "float64", ("--seq-len", "20")),
    # A row per (question, choice): the batch's 3 rows one question's choices.
    ("AlbertForMultipleChoice", "float32", ("--batch", "3")),
    ("ModernBertForMultipleChoice", "float64", ("--batch", "3", "--seq-len", "20")),
    ("DebertaV2ForMultipleChoice", "float32", ("--batch", "3", "--seq-len", "20")),
])
def test_verify_heads_and_families(tvmbert, saved, tmp_path, model, dtype, args):
    outcome = tvmbert("verify", saved.get(model, model), "--dtype", dtype, *args, "--log-dir", str(tmp_path), "--json")
    assert outcome.code == 0, outcome.stderr
    result = outcome.json
    source = models.resolve(saved.get(model, model), task=dict(zip(args[::2], args[1::2])).get("--task"))
    assert [o["name"] for o in result["outputs"]] == list(models.load(source).output_names)
    assert result["passed"] and result["samples"] == 3


@pytest.mark.parametrize("model", ["distilbert-tiny", "albert-tiny"])
def test_training_dispatch_on_a_layer_of_each_family(tvmbert, tmp_path, model):
    outcome = tvmbert("verify", model, "--train", "--log-dir", str(tmp_path), "--json")
    assert outcome.code == 0, outcome.stderr
    result = outcome.json
    assert result["passed"], result
    assert result["layer"].startswith({"distilbert-tiny": "TransformerBlock", "albert-tiny": "AlbertLayer"}[model])


def test_trace_names_the_family_and_task(tvmbert, saved):
    outcome = tvmbert("trace", saved["DistilBertForTokenClassification"], "--json")
    assert outcome.code == 0, outcome.stderr
    meta = outcome.json
    assert meta["family"] == "distilbert" and meta["task"] == "token-classification"
    assert sorted(meta["inputs"]) == ["attention_mask", "input_ids"]
    assert [o["name"] for o in meta["outputs"]] == ["logits"] and meta["outputs"][0]["shape"] == [1, 14, 5]


@pytest.mark.parametrize("model, args", [
    ("distilbert-tiny", ("--padding", "0.25")),
    ("DistilBertForTokenClassification", ()),
    ("AlbertForQuestionAnswering", ()),
])
def test_bench_checks_every_engine_on_each_family(tvmbert, saved, tmp_path, model, args):
    """ONNX Runtime is fed exactly the family's inputs; per-token outputs are compared on real tokens."""
    outcome = tvmbert("bench", saved.get(model, model), "--engines", "torch-eager,torch-sdpa,onnxruntime", *args,
                      "--repeat", "3", "--min-time", "0", "--warmup", "1", "--log-dir", str(tmp_path), "--json")
    assert outcome.code == 0, outcome.stderr
    engines = outcome.json["engines"]
    assert all("median_ms" in engines[name] and engines[name]["accuracy"]["within"]
               for name in ("tvm", "torch-eager", "torch-sdpa", "onnxruntime")), engines


def test_bench_says_why_a_family_without_sdpa_has_no_torch_sdpa_row(tvmbert, saved, tmp_path):
    """DeBERTa-v2 has no SDPA attention in transformers: torch-sdpa is skipped with that reason,
    not with transformers' error from loading it."""
    outcome = tvmbert("bench", saved["DebertaV2ForQuestionAnswering"], "--engines", "torch-sdpa", "--repeat", "1",
                      "--min-time", "0", "--warmup", "0", "--log-dir", str(tmp_path), "--json")
    assert outcome.code == 0, outcome.stderr
    assert outcome.json["engines"]["torch-sdpa"] == {
        "skipped": "transformers has no SDPA attention for DebertaV2ForQuestionAnswering (torch-eager and torch-compile "
                   "time the attention it has)"}


def test_records_of_an_equal_kernel_of_another_model_apply(tvmbert, tuned_schedules):
    """ALBERT's layer norms are bert-tiny's, structurally, but their blocks are named after other
    Relax variables (lv89_sum, not lv14_sum): the records' traces are renamed, not replayed blind."""
    tuned = tuned_schedules
    built = tvmbert("build", "albert-tiny", *WITHOUT_KERNELS, "--log-dir", str(tuned), "--json")
    assert built.code == 0, built.stderr
    reused = [name for name, where in built.json["schedules"].items() if where == "native"]
    assert any(name.startswith("layer_norm") for name in reused), built.json["schedules"]
    verified = tvmbert("verify", "albert-tiny", *WITHOUT_KERNELS, "--log-dir", str(tuned), "--json")
    assert verified.code == 0 and verified.json["passed"], verified.stderr


def test_albert_stores_its_shared_layer_once(tvmbert, tmp_path):
    """Every layer reads the one shared layer's weights; each read gets its prepacked copy, which
    build stores (and the runtime holds) once."""
    import numpy as np

    from tvmbert.deploy.weights import PARAMS_FILE, SAME_AS, load_params

    built = tvmbert("build", "albert-tiny", "--log-dir", str(tmp_path), "--json")
    assert built.code == 0, built.stderr
    params = Path(built.json["artifact"]).parent / PARAMS_FILE
    with np.load(params) as stored:
        assert any(SAME_AS in key for key in stored.files)
    weights = load_params(params)
    distinct = {id(w): w for w in weights.values()}
    assert built.json["weight_bytes"] == sum(w.nbytes for w in distinct.values()) < sum(w.nbytes for w in weights.values())


@pytest.mark.parametrize("name", ["modernbert-tiny", "deberta-v3-tiny"])
def test_position_tables_hold_transformers_numbers(name):
    """ModernBERT's rotary tables and DeBERTa's relative-position buckets, made once at load
    (frontend/exact.py), give what transformers' own model computes, in every layer and on padded rows."""
    import transformers

    source = models.resolve(name)
    config = models.preset_config(name)
    torch.manual_seed(0)
    plain = getattr(transformers, FAMILIES[source.family].model_prefix + "Model")(config).eval()
    tabled = models.load(source)
    ids = torch.randint(5, source.vocab_size, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, 13:] = 0
    with torch.no_grad():
        want = plain(input_ids=ids, attention_mask=mask).last_hidden_state
        got = tabled(ids, mask)[0]
    assert got.shape == want.shape and torch.equal(got, want)


def test_modernberts_float64_reference_masks_padding_and_its_window_as_transformers_does():
    """The float64 model (its softmax in float64, ``exact.FLOAT64_ATTENTION``) against
    transformers' own eager model in float32, on padded rows 20 tokens long (the tiny preset's
    window is 4 either side): transformers makes no mask for an attention it has no mask
    function for, so without one registered the float64 model saw the padding and no window."""
    import transformers

    source = models.resolve("modernbert-tiny")
    torch.manual_seed(0)
    plain = transformers.ModernBertModel(models.preset_config("modernbert-tiny")).eval()
    exact = models.load(source, "float64")
    ids = torch.randint(5, source.vocab_size, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, 13:] = 0
    with torch.no_grad():
        want = plain(input_ids=ids, attention_mask=mask).last_hidden_state.double()
        got = exact(ids, mask)[0]
    real = mask.bool()
    assert (got[real] - want[real]).abs().max() < 1e-5


def test_build_names_the_kernels_a_family_cannot_take(tvmbert, tmp_path, monkeypatch):
    """A family's table entry says which of our kernels its graph cannot take, and why: build says
    so where the kernel is in the pipeline and did not apply (every family takes them all today)."""
    import dataclasses

    from tvmbert.core import families

    never = {"attention": "its attention is not the kernel's", "int8": "an int8 build's alone"}
    monkeypatch.setitem(families.FAMILIES, "deberta-v2",
                        dataclasses.replace(families.FAMILIES["deberta-v2"], kernels_not_applied=never))
    monkeypatch.setattr("tvmbert.passes.attention_graph.attention_at", lambda *args: None)
    built = tvmbert("build", "deberta-v3-tiny", "--batch", "2", "--log-dir", str(tmp_path), "--workdir", str(tmp_path / "work"),
                    "--json")  # a workdir of its own: no other test's cached build
    assert built.code == 0, built.stderr
    assert built.json["kernels_not_applied"] == {"attention": "its attention is not the kernel's"}
    assert "do not apply to deberta-v2" in built.stderr and "not the kernel's" in built.stderr
    assert_one_line_error(tvmbert("build", "deberta-v3-tiny", "--batch", "2", "--tokens", "20"),
                          "packed builds of deberta-v2 models are not supported yet")


@pytest.mark.skipif(not HOST_LANES, reason="our kernels need AVX2 and FMA, which this CPU lacks")
def test_modernbert_runs_on_our_kernels_its_local_attention_on_its_window(tvmbert, workdir, tmp_path):
    """Its bias-free matmuls on the FMA kernel, its rotary Q and K read by the attention kernel,
    and its local layers' mask (a 4-token window here) computed in the kernel from the key
    padding, only the key blocks within the window: no [batch, 1, seq, seq] mask is made. At 256
    tokens the window skips whole blocks of keys; verify compares padded batches."""
    args = ("modernbert-tiny", "--batch", "2", "--seq-len", "256", "--log-dir", str(tmp_path))
    built = tvmbert("build", *args, "--json")
    assert built.code == 0, built.stderr
    assert built.json["kernels_not_applied"] == {} and built.json["layer_norm_kernels"], built.json
    assert any(name.endswith("_residual") for name in built.json["fma_kernels"]) and len(built.json["fma_kernels"]) >= 3
    assert sorted(built.json["attention_kernels"]) == ["attention_2x2x256x32_masked", "attention_2x2x256x32_masked_window4"]
    optimized = (workdir / "modernbert-tiny" / "b2-s256-float32" / "optimize" / "module.py").read_text()
    assert "R.Tensor((2, 1, 256, 256)" not in optimized and "R.Tensor((1, 1, 256, 256)" not in optimized
    for dtype in ("float32", "int8"):  # int8 on AMX: the AMX-BF16 attention kernel's window
        verified = tvmbert("verify", *args, "--dtype", dtype, "--samples", "4", "--json")
        assert verified.code == 0 and verified.json["passed"], (dtype, verified.stderr)


@pytest.mark.skipif(not HOST_LANES, reason="our kernels need AVX2 and FMA, which this CPU lacks")
def test_modernbert_rotates_q_and_k_in_its_projections_kernel_and_gates_in_its_mlps(tvmbert, tmp_path):
    """Heads of 64 (ModernBERT-base's), one panel each with AVX-512: the fused Q/K/V projection's
    kernel writes head-major panels with the rotary positions applied to Q's and K's as it stores
    them, and the attention kernel reads all three there (no rotary, slice or copy kernels, in
    padded and packed builds); Wi's kernel applies GeGLU and writes its half of the columns.
    With AVX2 the panels are narrower than a head: the graph rotates Q and K, and V is still
    read in place, from the projection's columns."""
    folder = _save(tmp_path / "model", "ModernBertModel", **dict(MODERNBERT_SMALL, hidden_size=128, num_hidden_layers=3,
                                                                 intermediate_size=96, max_position_embeddings=128))
    common = ("--batch", "2", "--seq-len", "64", "--log-dir", str(tmp_path), "--workdir", str(tmp_path / "work"))
    for packed in ((), ("--tokens", "100")):
        built = tvmbert("build", folder, *common, *packed, "--json")
        assert built.code == 0, built.stderr
        rows = "100" if packed else "128"
        assert f"fma_matmul_{rows}x192x128_gelu_gated" in built.json["fma_kernels"], built.json
        rotating = f"fma_matmul_{rows}x384x128_panels_rotary"
        assert (rotating in built.json["fma_kernels"]) == (HOST_LANES == 16), built.json
        assert all(name.endswith("_panels64") == (HOST_LANES == 16) for name in built.json["attention_kernels"]), built.json
        optimized = next((tmp_path / "work").glob(f"*/b2-s64-{'t100-' if packed else ''}float32/optimize/module.py")).read_text()
        called = set(re.findall(r"R\.call_tir\(cls\.(\w+)", optimized.split("def main(")[1]))
        graphs = {name for name in called if not name.startswith(("fma_matmul_", "attention_", "layer_norm_"))}
        rotary = {name for name in graphs if "negative" in name}  # rotate_half's negation: the graph's rotary kernels
        assert bool(rotary) == (HOST_LANES != 16), graphs
        # besides them, no GeGLU kernel and no slice of the projection copied (V)
        assert not any(op in name for name in graphs - rotary for op in ("split", "gelu", "squeeze", "strided_slice")), graphs
        verified = tvmbert("verify", folder, *common, *packed, "--samples", "4", "--json")
        assert verified.code == 0 and verified.json["passed"] and verified.json["max_abs_diff"] < 1e-5, verified.stderr


@pytest.mark.skipif(not HOST_LANES, reason="our kernels need AVX2 and FMA, which this CPU lacks")
def test_modernbert_in_int8_rotates_in_its_projections_kernel_and_quantizes_in_its_norms(tvmbert, tmp_path):
    """In int8 as in fp32: with AVX-512 (and no AMX, whose tiles take the projection), the int8
    Q/K/V projection writes head-major panels, Q's and K's rotated, for the attention kernel (its
    matmuls in int8 with AVX-512 VNNI: the local layers' windowed, the global ones'). The
    norm before each projection and each MLP, read by nothing else, quantizes the rows itself:
    the one left unfused is the embeddings' (read by the first layer's residual too)."""
    folder = _save(tmp_path / "model", "ModernBertModel", **dict(MODERNBERT_SMALL, hidden_size=128, num_hidden_layers=3,
                                                                 intermediate_size=96, max_position_embeddings=128))
    common = ("--batch", "2", "--seq-len", "64", "--dtype", "int8", "--log-dir", str(tmp_path), "--workdir", str(tmp_path / "work"))
    built = tvmbert("build", folder, *common, "--json")
    assert built.code == 0, built.stderr
    rotating = "int8_matmul_128x384x128_panels_rotary" in built.json["int8_kernels"]
    assert rotating == (HOST_LANES == HOST_TARGET.int8_lanes == 16 and not HOST_AMX_INT8), built.json
    assert all(("_panels64" in name) == rotating and name.endswith("_int8") == HOST_INT8_ATTENTION
               for name in built.json["attention_kernels"]), built.json
    assert "layer_norm_2x64x128_to_int8_rows" in built.json["layer_norm_kernels"], built.json
    optimized = next((tmp_path / "work").glob("*/b2-s64-int8/optimize/module.py")).read_text()
    called = re.findall(r"R\.call_tir\(cls\.(\w+)", optimized.split("def main(")[1])
    # 2 attention norms (the first layer's is the identity: its projection reads the embeddings' norm) and 3 MLP norms
    assert called.count("layer_norm_2x64x128_to_int8_rows") == 5 and called.count("layer_norm_2x64x128") == 1, called
    assert any("negative" in name for name in called) != rotating  # rotate_half's negation: the graph's rotary kernels
    verified = tvmbert("verify", folder, *common, "--samples", "4", "--json")
    assert verified.code == 0 and verified.json["passed"], verified.stderr


@pytest.mark.skipif(not HOST_LANES, reason="our kernels need AVX2 and FMA, which this CPU lacks")
def test_debertas_attention_runs_on_our_kernel_with_its_position_scores(tvmbert, workdir, tmp_path):
    """Its flat [batch x heads, seq, seq] scores, the c2p and p2c terms added and the mask applied
    by ``where``: one kernel call a layer, which computes the c2p and p2c products from Q and K
    and gathers the terms from them as it scores; no [batch x heads, seq, seq] tensor is made,
    and the mask is one [batch, 1, seq, seq] for every layer. In int8 on AMX the AMX kernel
    gathers them too, from the graph's products."""
    args = ("deberta-v3-tiny", "--batch", "2", "--seq-len", "64", "--log-dir", str(tmp_path))
    built = tvmbert("build", *args, "--json")
    assert built.code == 0, built.stderr
    assert built.json["attention_kernels"] == ["attention_2x2x64x32_masked_positions"], built.json
    optimized = (workdir / "deberta-v3-tiny" / "b2-s64-float32" / "optimize" / "module.py").read_text()
    assert "R.Tensor((4, 64, 64)" not in optimized and "R.Tensor((2, 2, 64, 64)" not in optimized
    assert optimized.count('out_ty=R.Tensor((2, 1, 64, 64), dtype="float32")') == 1
    assert "R.call_tir(cls.matmul" not in optimized  # the kernel computes c2p and p2c from Q and K
    assert 'by_query: T.Buffer((2, 32, 16), "float32")' in optimized  # from each head's position keys, not each sequence's
    for dtype in ("float32", "int8"):
        verified = tvmbert("verify", *args, "--dtype", dtype, "--samples", "4", "--json")
        assert verified.code == 0 and verified.json["passed"], (dtype, verified.stderr)
    if HOST_AMX:  # int8's attention on AMX-BF16
        optimized = (workdir / "deberta-v3-tiny" / "b2-s64-int8" / "optimize" / "module.py").read_text()
        assert "attention_2x2x64x32_masked_positions_amx" in optimized and "R.Tensor((4, 64, 64)" not in optimized


@pytest.mark.skipif(not HOST_LANES, reason="our kernels need AVX2 and FMA, which this CPU lacks")
@pytest.mark.parametrize("terms", [["c2p"], ["p2c"]])
def test_a_deberta_with_one_position_term_computes_that_one_in_the_kernel(tvmbert, tmp_path, terms):
    """``pos_att_type`` may name one of the two terms: the kernel computes and gathers that one alone."""
    folder = _save(tmp_path / "model", "DebertaV2Model", **dict(DEBERTA_V3_SMALL, hidden_size=64, max_position_embeddings=64, pos_att_type=terms))
    args = (folder, "--batch", "2", "--seq-len", "64", "--log-dir", str(tmp_path), "--workdir", str(tmp_path / "work"))
    built = tvmbert("build", *args, "--json")
    assert built.code == 0 and built.json["attention_kernels"] == ["attention_2x2x64x32_masked_positions"], built.stderr
    verified = tvmbert("verify", *args, "--samples", "4", "--json")
    assert verified.code == 0 and verified.json["passed"], verified.stderr


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_deberta_v2_with_a_convolution_layer_verifies_in_its_dtype(tvmbert, tmp_path, dtype):
    """DeBERTa-v2 (xlarge's config) adds a Conv1d beside its first layer; TVM's importer would make
    it float32 whatever the model's dtype, and a float64 build would not type-check (float32:
    the converter that replaces TVM's gives the same model there)."""
    folder = _save(tmp_path / "model", "DebertaV2Model", **dict(DEBERTA_V3_SMALL, conv_kernel_size=3, conv_act="gelu"))
    verified = tvmbert("verify", folder, "--batch", "2", "--seq-len", "16", "--dtype", dtype, "--log-dir", str(tmp_path),
                       "--workdir", str(tmp_path / "work"), "--json")
    assert verified.code == 0 and verified.json["passed"], verified.stderr


def test_a_config_transformers_cannot_run_is_the_users_input_not_an_export_failure(tvmbert, tmp_path):
    """A pooler narrower than the hidden states saves, and fails in transformers' own forward: one
    line says so (exit 2), without torch's log of the failed op (its logger does not propagate:
    listened to where it is)."""
    import logging

    folder = _save(tmp_path / "model", "DebertaV2ForSequenceClassification",
                   **dict(DEBERTA_V3_SMALL, pooler_hidden_size=16, num_labels=3))
    logged, listener = [], logging.Handler()
    listener.emit = logged.append
    fake_tensor_log = logging.getLogger("torch._subclasses.fake_tensor")
    fake_tensor_log.addHandler(listener)
    try:
        outcome = tvmbert("build", folder, "--batch", "2", "--log-dir", str(tmp_path), "--workdir", str(tmp_path / "work"))
    finally:
        fake_tensor_log.removeHandler(listener)
    assert_one_line_error(outcome, "transformers' own DebertaV2ForSequenceClassification fails on it")
    assert not logged, [record.getMessage() for record in logged]


def test_a_deberta_v3_folder_with_its_sentencepiece_tokenizer_reads_text_and_exports_it(tvmbert, tmp_path):
    """DeBERTa-v3 ships its tokenizer as ``spm.model`` (a SentencePiece model) and no
    tokenizer.json: ``--text`` reads it, an export carries it; an unreadable one is one line."""
    import json

    import sentencepiece

    corpus = tmp_path / "corpus.txt"  # sentences with every letter, repeated into enough text for 200 pieces
    corpus.write_text("\n".join(f"{i} the quick brown fox jumps over the lazy dog; sphinx of black quartz, judge my vow {i * 7}"
                                for i in range(400)))
    sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "spm"), vocab_size=200,
                                             pad_id=0, bos_id=1, eos_id=2, unk_id=3, pad_piece="[PAD]", bos_piece="[CLS]",
                                             eos_piece="[SEP]", unk_piece="[UNK]", minloglevel=2)
    folder = Path(_save(tmp_path / "model", "DebertaV2ForTokenClassification", **dict(DEBERTA_V3_SMALL, vocab_size=200)))
    (folder / "spm.model").write_bytes((tmp_path / "spm.model").read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False, "vocab_type": "spm"}))
    common = ("--log-dir", str(tmp_path), "--workdir", str(tmp_path / "work"))
    verified = tvmbert("verify", str(folder), "--text", "the quick brown fox judges", "--seq-len", "32", *common, "--json")
    assert verified.code == 0 and verified.json["passed"], verified.stderr
    exported = tvmbert("export", str(folder), "--output", str(tmp_path / "package"), "--batch", "1", "--seq-len", "16", *common)
    assert exported.code == 0, exported.stderr
    assert (tmp_path / "package" / "tokenizer" / "spm.model").is_file()
    assert (tmp_path / "package" / "tokenizer" / "tokenizer.json").is_file()
    (folder / "spm.model").write_bytes(b"not a sentencepiece model")
    assert_one_line_error(tvmbert("verify", str(folder), "--text", "a test", *common), "cannot load the tokenizer in")


def test_debertas_position_scores_compute_only_the_relative_positions_the_text_reaches(tvmbert, workdir):
    """4 tokens reach relative positions -3 to 3: 7 of the tiny preset's 16 position columns
    (8 buckets either side), which the c2p and p2c matmuls compute alone (gather-columns), in
    fp32 and fp64 within verify's bars."""
    for dtype in ("float32", "float64"):
        verified = tvmbert("verify", "deberta-v3-tiny", "--batch", "2", "--seq-len", "4", "--dtype", dtype, "--json")
        assert verified.code == 0 and verified.json["passed"], (dtype, verified.stderr)
        optimized = (workdir / "deberta-v3-tiny" / f"b2-s4-{dtype}" / "optimize" / "module.py").read_text()
        assert optimized.count(f'R.Tensor((4, 4, 7), dtype="{dtype}")') >= 4 and "R.Tensor((4, 4, 16)" not in optimized


@pytest.mark.skipif(not HOST_LANES, reason="our kernels need AVX2 and FMA, which this CPU lacks")
def test_modernberts_bias_free_matmuls_run_in_int8(tvmbert, tmp_path):
    """Its linear layers have no bias: the int8 kernels take bare matmuls too (a zero bias), or an
    int8 build of it would quantize nothing."""
    built = tvmbert("build", "modernbert-tiny", "--batch", "2", "--seq-len", "20", "--dtype", "int8",
                    "--log-dir", str(tmp_path), "--json")
    assert built.code == 0, built.stderr
    assert len(built.json["int8_kernels"]) >= 3 and "int8" not in built.json["kernels_not_applied"], built.json
    verified = tvmbert("verify", "modernbert-tiny", "--batch", "2", "--seq-len", "20", "--dtype", "int8",
                       "--log-dir", str(tmp_path), "--json")
    assert verified.code == 0 and verified.json["passed"], verified.stderr


@pytest.mark.parametrize("model", ["modernbert-tiny", "deberta-v3-tiny"])
def test_training_refuses_a_layer_that_needs_more_than_its_mask(tvmbert, tmp_path, model):
    assert_one_line_error(tvmbert("verify", model, "--train", "--log-dir", str(tmp_path)), "--train", "not supported yet")


def test_modernberts_matmul_weights_count_its_fused_qkv_and_geglu():
    """bench's floor reads them: every Linear of its layers (its shapes are not BERT's)."""
    source = models.resolve("modernbert-tiny")
    layers = FAMILIES["modernbert"].layers(models.load(source).model.base_model)
    linear = sum(m.weight.numel() for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear))
    assert models.sizes(source).matmul_weights == linear


def test_every_familys_inputs_are_a_prefix_of_berts():
    """The traced signature (input_ids, attention_mask, token_type_ids=None) names every family's inputs."""
    from tvmbert.core.families import BERT_INPUTS

    for family in FAMILIES.values():
        assert family.inputs == BERT_INPUTS[: len(family.inputs)]


def _without(folder: str, copy: Path, prefix: str) -> str:
    """A copy of a saved directory whose weight file lacks the tensors named ``prefix``...: a head
    saved without its classifier, an encoder without its pooler."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, copy)
    weights = load_file(copy / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith(prefix)}, copy / "model.safetensors", metadata={"format": "pt"})
    return str(copy)


@pytest.mark.slow
def test_a_head_without_its_weights_is_refused_and_drawn_at_random_only_when_asked(tvmbert, saved, tmp_path):
    headless = _without(saved["BertForSequenceClassification"], tmp_path / "headless", "classifier.")
    for stage in ("build", "verify"):
        assert_one_line_error(tvmbert(stage, headless), "no weights for classifier.bias, classifier.weight",
                              "--task feature-extraction", "--allow-random-weights")
    assert_one_line_error(tvmbert("export", headless, "-o", str(tmp_path / "package")), "classifier.bias")
    assert not (tmp_path / "package").exists()
    # Asked for: the same seeded head in the build and in verify's reference, and every result says so.
    verified = tvmbert("verify", headless, "--allow-random-weights", "--json")
    assert verified.code == 0 and verified.json["passed"], verified.stderr
    assert verified.json["random_weights"] == ["classifier.bias", "classifier.weight"]
    built = tvmbert("build", headless, "--allow-random-weights", "--json")
    assert built.json["random_weights"] == ["classifier.bias", "classifier.weight"]
    human = tvmbert("verify", headless, "--allow-random-weights")
    assert "random weights" in human.stdout and "classifier.weight" in human.stdout
    # The way out the message names: the encoder alone has every weight it needs.
    encoder = tvmbert("verify", headless, "--task", "feature-extraction", "--json")
    assert encoder.code == 0 and encoder.json["passed"] and encoder.json["random_weights"] == []


def test_weights_tied_on_purpose_are_not_missing_and_an_encoder_without_its_pooler_leaves_pooler_output_out(saved, tmp_path):
    from safetensors import safe_open

    with safe_open(Path(saved["RobertaForMaskedLM"]) / "model.safetensors", "pt") as stored:
        assert "lm_head.decoder.weight" not in stored.keys()  # tied to the word embeddings: not saved
    assert models.load(models.resolve(saved["RobertaForMaskedLM"])).random_weights == ()
    poolerless = _without(saved["BertForPreTraining"], tmp_path / "poolerless", "bert.pooler.")
    model = models.load(models.resolve(poolerless, task="feature-extraction"))
    assert model.output_names == ("last_hidden_state",) and model.random_weights == ()
