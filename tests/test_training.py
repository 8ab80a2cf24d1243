"""add_tvm_dispatch: BertLayer forward and backward through TVM inside PyTorch autograd."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tvmbert.training import autodiff, dispatch


def _bert_layer(dtype=torch.float32, attention="eager"):
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    from tvmbert.core.families import PRESETS

    torch.manual_seed(0)
    layer = BertLayer(BertConfig(**PRESETS["bert-tiny"].sizes, attn_implementation=attention)).to(dtype).train()
    hidden = torch.randn(1, 14, layer.attention.self.all_head_size, dtype=dtype)
    mask = torch.zeros(1, 1, 1, 14, dtype=dtype)
    mask[..., -4:] = torch.finfo(dtype).min  # four padding tokens
    return layer, (hidden, mask)


def _train_step(module, hidden, mask, grad_output, seed=7):
    x = hidden.clone().requires_grad_()
    torch.manual_seed(seed)  # the dropout masks
    output = module(x, mask)
    output.backward(grad_output)
    grads = {"input": x.grad, **{name: p.grad.clone() for name, p in module.named_parameters()}}
    torch.optim.SGD(module.parameters(), lr=0.1).step()
    return output, grads


# SDPA attention (transformers' default) draws its dropout mask inside the kernel: it must match too.
@pytest.fixture(scope="module", params=[(torch.float32, "eager"), (torch.float64, "eager"), (torch.float32, "sdpa"),
                                        (torch.float64, "sdpa")], ids=["float32", "float64", "float32-sdpa", "float64-sdpa"])
def layers(request, tmp_path_factory):
    layer, inputs = _bert_layer(*request.param)
    compiled = dispatch.add_tvm_dispatch(copy.deepcopy(layer), inputs, log_dir=tmp_path_factory.mktemp("logs"))
    return layer, compiled, inputs


def test_forward_gradients_and_optimizer_step_match_pytorch_with_dropout_on(layers):
    reference, compiled, (hidden, mask) = layers
    reference, compiled = copy.deepcopy(reference), copy.deepcopy(compiled)
    assert reference.attention.self.dropout.p > 0 and reference.training
    forward_tol, grad_tol = (1e-5, 1e-4) if hidden.dtype == torch.float32 else (1e-10, 1e-10)
    grad_output = torch.randn(hidden.shape, dtype=hidden.dtype, generator=torch.Generator().manual_seed(3))

    want, want_grads = _train_step(reference, hidden, mask, grad_output)
    got, got_grads = _train_step(compiled, hidden, mask, grad_output)

    assert type(got.grad_fn).__name__ == "TVMBertLayerBackward"
    assert (got - want).abs().max() <= forward_tol
    assert set(got_grads) == set(want_grads)
    for name, grad in want_grads.items():
        assert (got_grads[name] - grad).abs().max() <= grad_tol, name
    for p, q in zip(compiled.parameters(), reference.parameters()):
        assert (p - q).abs().max() <= grad_tol
    # Dropout really is on: another seed gives another output.
    torch.manual_seed(8)
    assert (compiled(hidden, mask) - got).abs().max() > 1e-3


def test_other_shapes_fall_back_to_pytorch_and_say_so_once(layers, capsys):
    _, compiled, (hidden, mask) = layers
    compiled = copy.deepcopy(compiled)
    layer_dispatch = dispatch.dispatch_of(compiled)
    layer_dispatch.verbose = True
    other = (torch.cat([hidden, hidden]), torch.cat([mask, mask]))
    for _ in range(2):
        torch.manual_seed(1)
        got = compiled(*other)
        torch.manual_seed(1)
        want = layer_dispatch.original_forward(*other)
        assert torch.equal(got, want) and "TVM" not in type(got.grad_fn).__name__
    assert layer_dispatch.calls["fallback"] == 2
    assert capsys.readouterr().err.count("runs in PyTorch") == 1
    # Parameters cast after compiling: PyTorch's own forward (and its dtype error), never TVM on wrong data.
    compiled.to(torch.float64 if hidden.dtype == torch.float32 else torch.float32)
    with pytest.raises(RuntimeError):
        compiled(hidden, mask)
    assert layer_dispatch.calls["fallback"] == 3 and layer_dispatch.calls["tvm"] == 0


def test_eval_mode_compiles_without_dropout_and_matches(layers):
    reference, compiled, (hidden, mask) = layers
    reference, compiled = copy.deepcopy(reference).eval(), copy.deepcopy(compiled).eval()
    got, want = compiled(hidden, mask), reference(hidden, mask)
    tolerance = 1e-5 if hidden.dtype == torch.float32 else 1e-10
    assert (got - want).abs().max() <= tolerance
    assert dispatch.dispatch_of(compiled).compiled_for(dispatch.dispatch_of(compiled).mode()).dropout == []


def test_saved_activations_are_matmul_outputs_and_fewer_bytes_than_pytorch(layers):
    reference, compiled, (hidden, mask) = layers
    layer_dispatch = dispatch.dispatch_of(compiled)
    split = layer_dispatch.compiled_for(layer_dispatch.mode()).split
    # q, k, v, the scores, the context, and the three dense layers: elementwise work is recomputed.
    assert len(split.saved) == 8
    x = hidden.clone().requires_grad_()
    tvm_bytes = dispatch.saved_activation_bytes(compiled, (x, mask))
    torch_bytes = dispatch.saved_activation_bytes(reference, (x, mask))
    masks = sum(math.prod(site.shape) for site in layer_dispatch.compiled_for(layer_dispatch.mode()).dropout) * hidden.element_size()
    assert tvm_bytes == split.saved_bytes + masks
    assert tvm_bytes < torch_bytes


def test_remove_restores_the_module_forward(layers):
    reference, compiled, (hidden, mask) = layers
    compiled = copy.deepcopy(compiled)
    dispatch.remove_tvm_dispatch(compiled)
    assert "forward" not in compiled.__dict__
    output = compiled(hidden.clone().requires_grad_(), mask)
    assert "TVM" not in type(output.grad_fn).__name__


def test_scalar_target_drops_the_ones_multiply():
    """The adjoint of sum(out * g) is g itself, not broadcast(1) * g."""
    from tvm import relax

    layer, inputs = _bert_layer()
    main, *_ = dispatch.export(layer.forward, layer, inputs)
    split = autodiff.differentiate(main, [0])
    ops = []
    relax.analysis.post_order_visit(split.module["backward"].body, lambda e: isinstance(e, relax.Call)
                                    and hasattr(e.op, "name") and ops.append(e.op.name))
    assert "relax.ones" not in ops and "relax.broadcast_to" not in ops[:3]


def test_bad_sample_inputs_are_an_input_error():
    from tvmbert.core.errors import InputError

    layer, _ = _bert_layer()
    with pytest.raises(InputError):
        dispatch.add_tvm_dispatch(layer, ["not a tensor"])


def test_verify_train_cli(tvmbert, tmp_path):
    outcome = tvmbert("verify", "bert-tiny", "--train", "--json", "--log-dir", str(tmp_path))
    assert outcome.code == 0, outcome.stderr
    result = outcome.json
    assert result["passed"] and result["forward_max_abs_diff"] <= 1e-5 and result["grad_max_abs_diff"] <= 1e-4
    assert result["fallback"]["ran_in_pytorch"] and len(result["grads"]) == 17  # input + 16 parameters
    assert result["saved_bytes"]["tvm"] < result["saved_bytes"]["torch"]


@pytest.mark.slow
def test_bench_train_cli(tvmbert, tmp_path):
    outcome = tvmbert("bench", "bert-tiny", "--train", "--json", "--repeat", "3", "--min-time", "0", "--warmup", "1",
                      "--log-dir", str(tmp_path))
    assert outcome.code == 0, outcome.stderr
    report = outcome.json
    assert set(report["engines"]) == {"tvm", "torch-eager"} and report["ratio"] > 0
    assert report["engines"]["tvm"]["runs"] >= 3


@pytest.mark.slow
def test_tune_train_tunes_the_layer_kernels_that_dispatch_then_applies(tvmbert, tmp_path):
    outcome = tvmbert("tune", "bert-tiny", "--train", "--kernel", "^NT_matmul", "--trials", "8", "--trials-per-task", "4",
                      "--log-dir", str(tmp_path), "--json")
    assert outcome.code == 0, outcome.stderr
    tuned = {t["name"] for t in outcome.json["tasks"] if t["best_us"] is not None}
    assert tuned and all(name.startswith("NT_matmul") for name in tuned)
    verified = tvmbert("verify", "bert-tiny", "--train", "--log-dir", str(tmp_path), "--json")
    assert verified.code == 0, verified.stderr
    assert verified.json["tasks_tuned"] == len(tuned) < verified.json["tasks_total"]


def test_sdpa_dropout_that_cannot_be_replayed_runs_in_pytorch_and_says_so(monkeypatch, tmp_path):
    """A kernel that draws its dropout mask its own way (fused GPU SDPA): train mode runs PyTorch's
    forward, with one warning naming the layer; eval mode, without dropout, still runs in TVM."""
    real = torch.nn.functional.scaled_dot_product_attention

    def own_random_stream(*args, **kwargs):
        torch.rand(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", own_random_stream)
    layer, (hidden, mask) = _bert_layer(attention="sdpa")
    with pytest.warns(UserWarning, match="BertLayer runs in PyTorch.*dropout mask inside its kernel"):
        compiled = dispatch.add_tvm_dispatch(copy.deepcopy(layer), (hidden, mask), log_dir=tmp_path)
    torch.manual_seed(5)
    got = compiled(hidden, mask)
    torch.manual_seed(5)
    assert torch.equal(got, layer(hidden, mask)) and "TVM" not in type(got.grad_fn).__name__
    layer.eval(), compiled.eval()
    got = compiled(hidden, mask)
    assert type(got.grad_fn).__name__ == "TVMBertLayerBackward" and (got - layer(hidden, mask)).abs().max() <= 1e-5
