"""Bad input: one clear line on stderr, exit 2, never a traceback."""

from __future__ import annotations

import pytest


def assert_one_line_error(outcome, *fragments, code=2):
    assert outcome.code == code, (outcome.stdout, outcome.stderr)
    lines = [line for line in outcome.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), outcome.stderr
    assert "Traceback" not in outcome.stderr
    assert len([line for line in lines if line.startswith("error: ")]) == 1
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]


def test_missing_directory(tvmbert, tmp_path):
    assert_one_line_error(tvmbert("trace", str(tmp_path / "nope")), "does not exist")


def test_directory_that_is_not_a_model(tvmbert, tmp_path):
    assert_one_line_error(tvmbert("trace", str(tmp_path)), "config.json is missing")


def test_directory_with_a_model_that_is_not_bert_like(tvmbert, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    assert_one_line_error(tvmbert("trace", str(tmp_path)), "gpt2", "BERT-like")


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
