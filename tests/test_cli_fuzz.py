"""Any options at all: exit 2 with exactly one `error:` line (or the help), never a traceback,
nothing written.

Property-based (hypothesis) over the shared options, on commands that check their input before
doing any work: with --no-deps and an empty work directory, valid options end at the missing
artifact, so no example exports, builds or times anything.
"""

from __future__ import annotations

import contextlib
import io

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tvmbert.cli import main

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "who", "was", "jim", "henson", "?"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """An empty work directory, and a model directory with a tokenizer (for --text)."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizer

    model = tmp_path_factory.mktemp("tokenized-bert")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(WORDS), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=16)).save_pretrained(model)
    (model / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    BertTokenizer(str(model / "vocab.txt")).save_pretrained(model)
    return tmp_path_factory.mktemp("empty-work"), str(model)


def garbage(*good: str):
    """One of ``good`` (which has bad values too) two times in three, else any text."""
    return st.integers(0, 2).flatmap(lambda i: st.text(max_size=12) if i == 0 else st.sampled_from(good))


def small_numbers(many: bool):
    """Numbers as a user may type them, garbage included; never a huge batch (it would allocate it)."""
    number = st.one_of(st.integers(-3, 40).map(str), st.sampled_from(["", " ", "x", "1.5", "0x10", "1e3", "٣", "1_0"]))
    return st.one_of(number, st.lists(number, min_size=2, max_size=3).map(",".join) if many else number)


def _fits(text) -> bool:
    try:
        return all(int(part) <= 64 for part in str(text).split(",") if part.strip())
    except ValueError:
        return True


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_any_options_give_one_error_line_and_exit_2(folders, data):
    workdir, tokenized = folders
    command = data.draw(st.sampled_from(["build", "verify", "bench"]))
    argv = [command, data.draw(garbage("bert-tiny", "bert-mini", tokenized, "bert-tiny-x", "./nope", ""))]
    options = {
        "--batch": small_numbers(many=command == "bench"),
        "--seq-len": small_numbers(many=command == "bench"),
        "--dtype": garbage("float32", "float64", "float16", "bfloat16", "int8"),
        "--target": garbage("llvm", "cuda", "rocm", "llvm -mcpu=skylake-avx512", "llvm -mcpu=notacpu", "llvm -mcpu=../x",
                            "cuda -arch=sm_80", "rocm -mcpu=gfx90a", "llvm -mcpu='x", '{"kind": "llvm"}', "{"),
        "--seed": garbage("0", "1", "-1", str(2**70), "1.5"),
        "--text": garbage("who was jim henson ?", "", " ", "henson " * 20),
    }
    if command == "bench":
        options["--padding"] = garbage("0", "0.5", "0,0.25", "1", "-0.1", "nan", "x")
    for name, strategy in options.items():
        if data.draw(st.booleans()):
            argv += [name, data.draw(strategy)]
    assume(_fits(dict(zip(argv, argv[1:])).get("--batch", "")))
    argv += ["--no-deps", "--workdir", str(workdir)]

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(argv)
    lines = [line for line in stderr.getvalue().splitlines() if line.strip()]
    assert "Traceback" not in stderr.getvalue(), argv
    if code == 0:  # a drawn "-h" or "--help": the help, and nothing else
        assert "Usage:" in stdout.getvalue() and not lines, argv
    else:  # never 1: an internal failure on bad input is a bug
        assert code == 2, (argv, stderr.getvalue())
        assert [line for line in lines if line.startswith("error:")] == lines[-1:], (argv, lines)
    assert not any(workdir.iterdir()), argv
