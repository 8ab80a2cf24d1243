"""Models: presets with seeded weights, and local HuggingFace directories that are not presets."""

from __future__ import annotations

import pytest
import torch

from tvmbert.frontend import models

WORDS = ["who", "was", "jim", "henson", "?", "a", "puppet", "##eer"]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A BERT-like directory unlike any preset (3 layers, hidden 64, 4 heads), with a tokenizer."""
    from transformers import BertConfig, BertModel, BertTokenizer

    folder = tmp_path_factory.mktemp("my-finetuned-bert")
    torch.manual_seed(3)
    config = BertConfig(vocab_size=200, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
                        max_position_embeddings=64)
    BertModel(config).save_pretrained(folder)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS] + [f"w{i}" for i in range(200 - 5 - len(WORDS))]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizer(str(folder / "vocab.txt")).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def roberta_dir(tmp_path_factory):
    """A RoBERTa directory with no tokenizer: deterministic ids, a single segment id."""
    from transformers import RobertaConfig, RobertaModel

    folder = tmp_path_factory.mktemp("roberta")
    torch.manual_seed(4)
    config = RobertaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                           max_position_embeddings=40)
    RobertaModel(config).save_pretrained(folder)
    return folder


def test_presets_are_seeded():
    source = models.resolve("bert-tiny")
    first, second = models.load(source, seed=0), models.load(source, seed=0)
    other = models.load(source, seed=1)
    weight = "model.encoder.layer.0.attention.self.query.weight"
    assert torch.equal(first.state_dict()[weight], second.state_dict()[weight])
    assert not torch.equal(first.state_dict()[weight], other.state_dict()[weight])


def test_bert_base_preset_is_bert_base_uncased():
    source = models.resolve("bert-base")
    config = models.preset_config("bert-base")
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.intermediate_size,
            config.vocab_size) == (12, 768, 12, 3072, 30522)
    assert source.max_positions == 512


def test_default_inputs_are_the_seed_shape():
    inputs = models.example_inputs(models.resolve("bert-tiny"), batch=1, seq_len=None, text=None)
    assert inputs.shape == (1, 14)
    assert inputs.attention_mask.all()


def test_tokenizer_gives_the_tutorial_input(bert_dir):
    inputs = models.example_inputs(models.resolve(str(bert_dir)), batch=1, seq_len=None, text=None)
    assert inputs.shape == (1, 14)
    assert inputs.tensors["token_type_ids"].tolist() == [[0] * 7 + [1] * 7]


def test_text_is_padded_to_seq_len(bert_dir):
    inputs = models.example_inputs(models.resolve(str(bert_dir)), batch=2, seq_len=20, text=None)
    assert inputs.shape == (2, 20)
    assert inputs.attention_mask.sum(dim=1).tolist() == [14, 14]


def test_text_longer_than_seq_len_or_empty_is_an_input_error(tvmbert, bert_dir):
    """The text used to be cut, or replaced by the default sentence, without a word."""
    longer = tvmbert("trace", str(bert_dir), "--text", "who was jim henson ? a puppeteer", "--seq-len", "3")
    assert longer.code == 2 and "--text has 8 tokens and --seq-len is 3" in longer.stderr
    for text in ("", "  "):
        empty = tvmbert("trace", str(bert_dir), "--text", text)
        assert empty.code == 2 and "'text' must be a text that is not empty" in empty.stderr


def test_local_bert_directory_end_to_end(tvmbert, bert_dir):
    for dtype, limit in (("float32", 1e-5), ("float64", 1e-10)):
        outcome = tvmbert("verify", str(bert_dir), "--dtype", dtype, "--json")
        assert outcome.code == 0, outcome.stderr
        assert outcome.json["max_abs_diff"] <= limit


def test_local_roberta_directory_without_tokenizer(tvmbert, roberta_dir):
    outcome = tvmbert("verify", str(roberta_dir), "--seq-len", "10", "--batch", "2", "--json")
    assert outcome.code == 0, outcome.stderr
    assert outcome.json["outputs"][0]["shape"] == [2, 10, 32]


def test_trace_of_a_directory_with_shape_options(tvmbert, bert_dir):
    outcome = tvmbert("trace", str(bert_dir), "--seq-len", "32", "--batch", "4", "--json")
    assert outcome.code == 0, outcome.stderr
    assert outcome.json["inputs"]["input_ids"]["shape"] == [4, 32]


@pytest.mark.parametrize("decomposed", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_a_float64_conv1d_imports_as_float64_and_computes_what_torch_does(decomposed, bias):
    """TVM's importer makes every convolution float32; ours keep a float64 Conv1d float64, as
    ``convolution.default`` (torch.export's decompositions) and as ``conv1d.default``."""
    import numpy as np
    import tvm
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    from tvmbert.frontend.conversions import dtype_preserving_ops

    torch.manual_seed(0)
    conv = torch.nn.Conv1d(6, 4, 3, padding=1, groups=2, bias=bias).double().eval()
    x = torch.randn(2, 6, 9, dtype=torch.float64)
    program = torch.export.export(conv, (x,))
    module = from_exported_program(program, run_ep_decomposition=decomposed, unwrap_unit_return_tuple=True,
                                   custom_convert_map=dtype_preserving_ops())
    assert "float32" not in module.script()
    executable = relax.build(module, target="llvm")
    got = relax.VirtualMachine(executable, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy()))
    with torch.no_grad():
        np.testing.assert_allclose(got.numpy(), conv(x).numpy(), rtol=1e-12, atol=1e-12)
