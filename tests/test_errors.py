"""Bad input: one clear line on stderr, exit 2, never a traceback."""

from __future__ import annotations

import re

import pytest

from helpers import assert_one_line_error


def test_missing_directory(tvmbert, tmp_path):
    assert_one_line_error(tvmbert("trace", str(tmp_path / "nope")), "does not exist")


def test_directory_that_is_not_a_model(tvmbert, tmp_path):
    assert_one_line_error(tvmbert("trace", str(tmp_path)), "config.json is missing")


def test_directory_with_a_model_that_is_not_bert_like(tvmbert, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    assert_one_line_error(tvmbert("trace", str(tmp_path)), "gpt2", "BERT-like")


def test_a_folder_whose_settings_name_no_model_points_at_the_model_above(tvmbert, tmp_path):
    """A sentence-transformers model's pooling folder has a config.json of its own."""
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text('{"word_embedding_dimension": 384}')
    pooling = str(tmp_path / "1_Pooling")
    assert_one_line_error(tvmbert("trace", pooling), "names no model_type", f"did you mean its parent '{tmp_path}'?")
    (tmp_path / "config.json").write_text('{"word_embedding_dimension": 384}')
    outcome = tvmbert("trace", pooling)
    assert_one_line_error(outcome, "names no model_type")
    assert "did you mean" not in outcome.stderr


def test_directory_without_weights(tvmbert, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    assert_one_line_error(tvmbert("trace", str(tmp_path)), "no weights")


def test_unknown_preset_suggests_close_ones(tvmbert):
    assert_one_line_error(tvmbert("trace", "bert-bsae"), "unknown model", "bert-base")


@pytest.mark.parametrize("value", ["0", "-3"])
def test_seq_len_must_be_positive(tvmbert, value):
    assert_one_line_error(tvmbert("trace", "bert-tiny", "--seq-len", value), "seq_len")


def test_seq_len_above_max_positions(tvmbert):
    assert_one_line_error(tvmbert("trace", "bert-tiny", "--seq-len", "513"), "max_position_embeddings")


def test_unknown_target(tvmbert):
    assert_one_line_error(tvmbert("build", "bert-tiny", "--target", "vulkan"), "unknown target")


@pytest.mark.parametrize("target, fragment", [("llvm -mcpu=notacpu", "LLVM knows no CPU"), ("llvm -mcpu='x", "No closing quotation")])
def test_bad_target_details(tvmbert, target, fragment):
    assert_one_line_error(tvmbert("build", "bert-tiny", "--target", target), fragment)


@pytest.mark.parametrize("option", ["--log-dir", "--workdir"])
def test_a_folder_option_that_is_a_file(tvmbert, tmp_path, option):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert_one_line_error(tvmbert("build", "bert-tiny", option, str(blocker)), option, "is a file, not a folder")
    assert_one_line_error(tvmbert("build", "bert-tiny", option, str(blocker / "below")), "is a file, not a folder")


def test_malformed_yaml(tvmbert, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("model: bert-tiny\nbatch: [1\n")
    assert_one_line_error(tvmbert("run", str(config), workdir_arg=False), str(config), "not valid YAML")


def test_unknown_yaml_key(tvmbert, tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text("model: bert-tiny\nseqlen: 12\n")
    assert_one_line_error(tvmbert("run", str(config), workdir_arg=False), str(config), "unknown key 'seqlen'")


def test_wrong_type_in_yaml(tvmbert, tmp_path):
    config = tmp_path / "type.yaml"
    config.write_text("model: bert-tiny\nbench:\n  repeat: many\n")
    assert_one_line_error(tvmbert("run", str(config), workdir_arg=False), str(config), "bench.repeat")


def test_unknown_pass_lists_known_ones(tvmbert):
    assert_one_line_error(tvmbert("optimize", "bert-tiny", "--disable", "combine-everything"), "unknown pass", "fold-constants")


def test_no_deps_without_previous_artifact(tvmbert, tmp_path):
    outcome = tvmbert("build", "bert-mini", "--no-deps", "--workdir", str(tmp_path))
    assert_one_line_error(outcome, "no optimize artifact", "tvmbert optimize bert-mini")


def test_text_without_tokenizer(tvmbert):
    assert_one_line_error(tvmbert("trace", "bert-tiny", "--text", "hello"), "tokenizer")


def test_missing_config_file(tvmbert, tmp_path):
    assert_one_line_error(tvmbert("run", str(tmp_path / "none.yaml"), workdir_arg=False), "does not exist")


def test_unknown_option_is_a_usage_error(tvmbert):
    assert_one_line_error(tvmbert("trace", "bert-tiny", "--frobnicate"), "--frobnicate")


@pytest.fixture(scope="module")
def built_tiny(workdir):
    from tvmbert import Job, JobConfig, build
    from tvmbert.deploy.compiled import CompiledModel

    job = Job(JobConfig(model="bert-tiny", workdir=str(workdir)))
    return CompiledModel(build(job), job), [t.numpy() for t in job.inputs.as_tuple()]


@pytest.mark.parametrize("name, value, fragment", [
    ("input_ids", 10**6, "input_ids holds 1000000 at [0, 3]: it must be in [0, 30522)"),
    ("input_ids", 30522, "in [0, 30522)"),
    ("input_ids", -1, "input_ids holds -1"),
    ("input_ids", 10**12, "in [0, 30522)"),
    ("token_type_ids", 5, "token_type_ids holds 5 at [0, 3]: it must be in [0, 2)"),
    ("attention_mask", 2, "attention_mask holds 2 at [0, 3]: it must be 0 or 1"),
])
def test_out_of_range_inputs_never_reach_the_library(built_tiny, name, value, fragment):
    """TVM's take does no bounds check: NaN, plausible garbage or a segfault otherwise."""
    import numpy as np

    from tvmbert.core.errors import InputError
    compiled, good = built_tiny
    arrays = [a.copy() for a in good]
    arrays[list(compiled.limits).index(name)][0, 3] = value
    with pytest.raises(InputError, match=re.escape(fragment)):
        compiled(arrays)
    assert all(np.isfinite(out).all() for out in compiled(good))


def test_inputs_of_another_shape_or_dtype_are_refused(built_tiny):
    from tvmbert.core.errors import InputError

    compiled, (ids, mask, segments) = built_tiny
    with pytest.raises(InputError, match=r"input_ids has shape \[1, 13\]; this build takes \[1, 14\]"):
        compiled([ids[:, :13], mask[:, :13], segments[:, :13]])
    with pytest.raises(InputError, match="attention_mask must hold integers, got float32"):
        compiled([ids, mask.astype("float32"), segments])
    assert compiled([ids.astype("int32"), mask, segments])[0].shape == (1, 14, 128)


@pytest.fixture(scope="module")
def small_bert(tmp_path_factory):
    """A saved BertModel (safetensors) to break in different ways."""
    import torch
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("small-bert")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                         max_position_embeddings=32)).save_pretrained(folder)
    return folder


def _broken(small_bert, tmp_path, how):
    import json
    import shutil

    import torch
    from safetensors.torch import load_file

    folder = tmp_path / "model"
    shutil.copytree(small_bert, folder)
    weights = folder / "model.safetensors"
    config = json.loads((folder / "config.json").read_text())
    if how == "truncated safetensors":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "garbage safetensors":
        weights.write_bytes(bytes(range(256)) * 20)
    elif how in ("truncated bin", "garbage bin"):
        state = load_file(weights)
        weights.unlink()
        torch.save(state, folder / "pytorch_model.bin")
        data = (folder / "pytorch_model.bin").read_bytes()
        (folder / "pytorch_model.bin").write_bytes(data[: len(data) // 2] if how == "truncated bin" else bytes(range(256)) * 20)
    elif how == "shapes":
        config.update(hidden_size=64, intermediate_size=128)
    elif how == "max_position_embeddings":
        config["max_position_embeddings"] = "abc"
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("how, fragment", [
    ("truncated safetensors", "cannot load the model"),
    ("garbage safetensors", "cannot load the model"),
    ("truncated bin", "cannot load the model"),
    ("garbage bin", "cannot load the model"),
    ("shapes", "do not match its config.json: embeddings.LayerNorm.bias is [32] in the weight file and [64] by config.json"),
    ("max_position_embeddings", "'max_position_embeddings' must be a number >= 1, got 'abc'"),
])
def test_a_broken_model_directory_is_bad_input(tvmbert, small_bert, tmp_path, how, fragment):
    """These were exit 1, "internal failure" (and a table of mismatched weights)."""
    assert_one_line_error(tvmbert("trace", str(_broken(small_bert, tmp_path, how))), fragment)


def test_config_json_that_is_not_an_object(tvmbert, tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    assert_one_line_error(tvmbert("trace", str(tmp_path)), "not a JSON object", "holds a list")


def test_a_file_given_as_the_model_directory(tvmbert, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert_one_line_error(tvmbert("trace", str(tmp_path / "config.json")), "is a file, not a model directory")


def test_binary_config_file(tvmbert, tmp_path):
    config = tmp_path / "binary.yaml"
    config.write_bytes(bytes(range(256)))
    assert_one_line_error(tvmbert("trace", "--config", str(config)), str(config), "cannot be read as a YAML text file")


@pytest.mark.parametrize("seed", ["-1", str(2**70)])
def test_seed_out_of_range(tvmbert, seed):
    assert_one_line_error(tvmbert("trace", "bert-tiny", "--seed", seed), "'seed' must be a number in [0, 2**32)")
