"""TVM inside PyTorch training: a module's forward and backward compiled by Relax, run by autograd.

``add_tvm_dispatch(module, sample_inputs)`` exports the module at the sample's shapes, derives
forward and backward with ``relax.transform.Gradient`` (see ``autodiff``), compiles both with
the target's tuning database and routes matching calls through a ``torch.autograd.Function``.
Tensors cross between PyTorch and TVM through DLPack, without copies.

Dropout: Relax's importer turns dropout into identity, so each dropout becomes a multiplication
by a mask that is an input of the compiled functions. At call time the masks are drawn by
PyTorch, site by site in the order the module calls dropout, exactly as PyTorch's own CPU
dropout draws them (``bernoulli_(1 - p)`` on a tensor like the input, divided by ``1 - p``): with
the same seed, TVM and PyTorch compute the same function.
"""

from __future__ import annotations

import contextlib
import math
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from tvmbert.core import targets
from tvmbert.core.config import user_log_dir
from tvmbert.core.console import to_stderr
from tvmbert.core.errors import InputError, first_line
from tvmbert.deploy.loader import check_cpu
from tvmbert.ir.tasks import Task, extract_tasks
from tvmbert.passes.pipeline import lowering
from tvmbert.training import autodiff

ATTRIBUTE = "_tvmbert_dispatch"
ENTRIES = ("forward", "backward")  # the Relax functions of a training module


@dataclass(frozen=True)
class DropoutSite:
    shape: tuple[int, ...]
    dtype: object  # torch.dtype
    p: float


@dataclass(frozen=True)
class Signature:
    """What a call must match to run in TVM."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple
    devices: tuple[str, ...]

    @classmethod
    def of(cls, tensors) -> Signature:
        return cls(tuple(tuple(t.shape) for t in tensors), tuple(t.dtype for t in tensors), tuple(str(t.device) for t in tensors))

    def describe(self) -> str:
        return ", ".join(f"{list(shape)} {str(dtype).removeprefix('torch.')}" for shape, dtype in zip(self.shapes, self.dtypes)) \
            + f" on {', '.join(sorted(set(self.devices)))}"


@dataclass
class Compiled:
    """One training mode's forward and backward, and how their arguments map to the module's."""

    vm: object
    dropout: list[DropoutSite]
    params: list[str]  # module parameter/buffer names, in the order the functions take them
    param_signature: Signature  # their shapes, dtypes and devices when compiled
    n_inputs: int
    n_outputs: int
    out_spec: object  # pytree spec of the module's output
    split: autodiff.Split
    tasks_total: int = 0
    untuned: list[str] = field(default_factory=list)

    @property
    def tasks_tuned(self) -> int:
        return self.tasks_total - len(self.untuned)

    @property
    def n_primal(self) -> int:
        return self.n_inputs + len(self.dropout) + len(self.params)


def add_tvm_dispatch(module, sample_inputs, target: str = "llvm", log_dir: str | Path | None = None,
                     verbose: bool = False):
    """Run ``module`` in TVM, forward and backward, for calls shaped like ``sample_inputs``.

    Other calls (shapes, dtypes, device, keyword arguments) fall back to the module's own
    forward; with ``verbose`` each new fallback signature is reported once, on stderr.
    ``log_dir``: this user's tuning logs (default: config.user_log_dir()), read before the shipped ones.
    """
    import torch

    if hasattr(module, ATTRIBUTE):
        remove_tvm_dispatch(module)
    inputs = (sample_inputs,) if isinstance(sample_inputs, torch.Tensor) else tuple(sample_inputs)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise InputError("add_tvm_dispatch: sample_inputs must be a tensor or a tuple of tensors")
    spec = targets.resolve(target)
    check_cpu("add_tvm_dispatch", spec.config)
    check_device(spec, inputs)
    dispatch = _Dispatch(module, inputs, spec, Path(log_dir) if log_dir else user_log_dir(), verbose)
    dispatch.compiled_for(dispatch.mode())  # compile now, for the module's current mode
    setattr(module, ATTRIBUTE, dispatch)
    module.forward = dispatch
    return module


def remove_tvm_dispatch(module):
    dispatch = module.__dict__.pop(ATTRIBUTE, None)
    if dispatch is not None:
        module.__dict__.pop("forward", None)
    return module


def dispatch_of(module) -> _Dispatch:
    return getattr(module, ATTRIBUTE)


class _Dispatch:
    def __init__(self, module, sample_inputs, target, log_dir: Path, verbose: bool):
        self.module = module
        self.original_forward = module.forward
        self.signature = Signature.of(sample_inputs)
        self.sample_inputs = tuple(t.detach() for t in sample_inputs)
        self.target = target
        self.log_dir = log_dir / target.key
        self.verbose = verbose
        self.compiled: dict[tuple, Compiled] = {}
        self.in_pytorch: dict[tuple, str] = {}  # modes TVM cannot compute as PyTorch does, and why
        self.reported: set = set()
        self.function = _autograd_function(type(module).__name__)
        self.calls = {"tvm": 0, "fallback": 0}

    def __deepcopy__(self, memo):
        """A copied module (an EMA copy, a checkpoint clone) dispatches too, sharing the compiled code."""
        import copy

        twin = copy.copy(self)
        memo[id(self)] = twin
        twin.module = copy.deepcopy(self.module, memo)
        twin.original_forward = self.original_forward.__func__.__get__(twin.module)
        twin.calls = {"tvm": 0, "fallback": 0}
        twin.reported = set()
        return twin

    def mode(self) -> tuple[bool, ...]:
        return tuple(m.training for m in self.module.modules())

    def __call__(self, *args, **kwargs):
        import torch

        if kwargs or len(args) != len(self.signature.shapes) or not all(isinstance(a, torch.Tensor) for a in args) \
                or Signature.of(args) != self.signature:
            return self._fallback(args, kwargs, self._mismatch(args, kwargs))
        mode = self.mode()
        compiled = self.compiled_for(mode)
        if compiled is None:
            return self._fallback(args, kwargs, self.in_pytorch[mode])
        params = [_lookup(self.module, name) for name in compiled.params]
        if Signature.of(params) != compiled.param_signature:
            return self._fallback(args, kwargs, "its parameters were moved or cast since add_tvm_dispatch compiled it")
        masks = [_draw_mask(site, args[0].device) for site in compiled.dropout]
        self.calls["tvm"] += 1
        outputs = self.function.apply(compiled, *args, *masks, *params)
        return torch.utils._pytree.tree_unflatten(list(outputs), compiled.out_spec)

    def _mismatch(self, args, kwargs) -> str:
        import torch

        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        got = Signature.of(tensors).describe() if tensors else "no tensors"
        return f"called with {got}" + (f" and keywords {', '.join(sorted(kwargs))}" if kwargs else "") \
            + f", TVM is compiled for {self.signature.describe()}"

    def _fallback(self, args, kwargs, why: str):
        self.calls["fallback"] += 1
        if self.verbose and why not in self.reported:
            self.reported.add(why)
            print(f"tvmbert: {type(self.module).__name__} runs in PyTorch: {why}", file=sys.stderr)
        return self.original_forward(*args, **kwargs)

    def compiled_for(self, mode: tuple[bool, ...]) -> Compiled | None:
        """The mode's forward and backward; None when TVM cannot compute what PyTorch computes
        in it (said once, as a warning: a silent fallback would hide a slower layer)."""
        if mode not in self.compiled and mode not in self.in_pytorch:
            why = unreplayable_attention_dropout(self.original_forward, self.sample_inputs)
            if why:
                self.in_pytorch[mode] = why
                self.reported.add(why)
                warnings.warn(f"tvmbert: {type(self.module).__name__} runs in PyTorch in this mode: {why}", stacklevel=3)
            else:
                self.compiled[mode] = compile_module(self.original_forward, self.module, self.sample_inputs,
                                                     self.target, self.log_dir)
        return self.compiled.get(mode)


def _autograd_function(name: str):
    """A Function class per module type, so ``grad_fn`` reads ``TVM<Module>Backward``."""
    import torch

    def forward(ctx, compiled: Compiled, *tensors):
        results = run(compiled, "forward", tensors)
        outputs, saved = results[:compiled.n_outputs], results[compiled.n_outputs:]
        ctx.compiled = compiled
        ctx.save_for_backward(*[tensors[i] for i in compiled.split.backward_primal], *saved)
        return tuple(outputs)

    def backward(ctx, *grad_outputs):
        compiled = ctx.compiled
        grads = run(compiled, "backward", (*ctx.saved_tensors, *[g.contiguous() for g in grad_outputs]))
        result = [None] * compiled.n_primal
        for index, grad in zip(compiled.split.grad_of, grads):
            if ctx.needs_input_grad[1 + index]:
                result[index] = grad
        return (None, *result)

    return type(f"TVM{name}", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


def run(compiled: Compiled, function: str, tensors) -> list:
    """One VM call: PyTorch tensors in and out through DLPack, no copies."""
    import torch
    import tvm

    args = [tvm.runtime.from_dlpack(t.detach().contiguous()) for t in tensors]
    results = compiled.vm[function](*args)
    return [torch.from_dlpack(r) for r in results]


def _draw_mask(site: DropoutSite, device):
    """What PyTorch's dropout multiplies by, drawn the way it draws it."""
    import torch

    if site.p >= 1:
        return torch.zeros(site.shape, dtype=site.dtype, device=device)
    return torch.empty(site.shape, dtype=site.dtype, device=device).bernoulli_(1 - site.p).div_(1 - site.p)


def _lookup(module, name: str):
    try:
        return module.get_parameter(name)
    except AttributeError:
        return module.get_buffer(name)


def attention_math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, dropout):
    """``scaled_dot_product_attention`` as PyTorch's math path computes it, with its dropout a call
    to ``dropout``."""
    import torch

    if enable_gqa:
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    scores = query @ key.transpose(-2, -1) * (scale if scale is not None else 1 / math.sqrt(query.size(-1)))
    if is_causal:
        attn_mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else scores + attn_mask
    return dropout(scores.softmax(-1), dropout_p, True) @ value


@contextlib.contextmanager
def _dropout_replaced(replacement):
    """``F.dropout`` becomes ``replacement``, and so does the dropout inside
    ``F.scaled_dot_product_attention``: with dropout on, SDPA runs as the math path."""
    import torch

    functional = torch.nn.functional
    original_dropout, original_attention = functional.dropout, functional.scaled_dot_product_attention

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if dropout_p == 0:
            return original_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                      enable_gqa=enable_gqa)
        return attention_math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, replacement)

    functional.dropout, functional.scaled_dot_product_attention = replacement, attention
    try:
        yield
    finally:
        functional.dropout, functional.scaled_dot_product_attention = original_dropout, original_attention


def _forked_rng(inputs):
    """PyTorch's random state (and the inputs' GPU's) as it was, after the block."""
    import torch

    return torch.random.fork_rng(devices=[inputs[0].device] if inputs[0].device.type == "cuda" else [])


def unreplayable_attention_dropout(forward, inputs) -> str | None:
    """Why TVM cannot draw the dropout masks of the module's SDPA calls as PyTorch's SDPA draws
    them, or None. Tried on each call's own inputs: the same seed through PyTorch's SDPA and
    through the math path the export uses; a kernel that draws its own mask gives other outputs."""
    import torch

    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention
    worst = []

    def trying(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if dropout_p > 0:
            with torch.enable_grad():  # as in training: the kernel PyTorch picks may depend on it
                q, k, v = (t.detach().requires_grad_() for t in (query, key, value))
                options = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
                torch.manual_seed(0)
                want = original(q, k, v, **options)
                torch.manual_seed(0)
                got = attention_math(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, functional.dropout)
            diff = float((got - want).abs().max())
            if not diff <= 100 * torch.finfo(want.dtype).eps * max(1.0, float(want.abs().max())):
                worst.append(diff)
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)

    functional.scaled_dot_product_attention = trying
    try:
        with _forked_rng(inputs), torch.no_grad():
            forward(*inputs)
    finally:
        functional.scaled_dot_product_attention = original
    if not worst:
        return None
    return (f"scaled_dot_product_attention on {inputs[0].device.type} draws its dropout mask inside its kernel, where "
            f"TVM cannot draw the same one (off by {max(worst):.2g} with the same seed); attn_implementation='eager' "
            "trains it in TVM")


def dropout_sites(forward, inputs) -> list[DropoutSite]:
    """The dropouts one call makes, in order; the random state is left as it was."""
    import torch

    sites = []

    def recording(input, p=0.5, training=True, inplace=False):
        if training and p > 0:
            sites.append(DropoutSite(tuple(input.shape), input.dtype, float(p)))
        return input

    with _forked_rng(inputs), torch.no_grad(), _dropout_replaced(recording):
        forward(*inputs)
    return sites


def _with_masks(forward, n_inputs: int):
    """The module as a function of (inputs, dropout masks), for export."""
    import torch

    class WithMasks(torch.nn.Module):
        def __init__(self, owner):
            super().__init__()
            self.owner = owner  # registers the parameters under "owner."

        def forward(self, *args):
            inputs, masks = args[:n_inputs], list(args[n_inputs:])

            def masked(input, p=0.5, training=True, inplace=False):
                return input * masks.pop(0) if training and p > 0 else input

            with _dropout_replaced(masked):
                return forward(*inputs)

    return WithMasks


def export(forward, module, inputs):
    """(Relax main, dropout sites, parameter names, output pytree spec) at the inputs' shapes."""
    import torch
    from tvm.relax.frontend.torch import from_exported_program

    from tvmbert.frontend.conversions import dtype_preserving_ops

    sites = dropout_sites(forward, inputs)
    masks = [torch.ones(s.shape, dtype=s.dtype, device=inputs[0].device) for s in sites]
    wrapper = _with_masks(forward, len(inputs))(module)
    try:
        program = torch.export.export(wrapper, (*inputs, *masks))
    except Exception as exc:
        raise InputError(f"add_tvm_dispatch: torch.export cannot trace {type(module).__name__}: "
                         f"{first_line(exc)}") from None
    relax_module = from_exported_program(program, keep_params_as_input=True,
                                         custom_convert_map=dtype_preserving_ops())
    main = relax_module["main"]
    targets_by_arg = {spec.arg.name: spec.target for spec in program.graph_signature.input_specs if spec.target}
    n_primal = len(inputs) + len(sites)
    params = [targets_by_arg[p.name].removeprefix("owner.") for p in main.params[n_primal:]]
    return main, sites, params, program.call_spec.out_spec


def training_module(forward, module, inputs):
    """The IRModule with "forward" and "backward", before lowering, and what goes with it."""
    import torch

    main, sites, params, out_spec = export(forward, module, inputs)
    n_primal = len(inputs) + len(sites)
    wrt = [i for i, t in enumerate(inputs) if t.is_floating_point()]
    wrt += [n_primal + i for i, name in enumerate(params)
            if isinstance(_lookup(module, name), torch.nn.Parameter) and _lookup(module, name).is_floating_point()]
    split = autodiff.differentiate(main, wrt)
    n_outputs = len(main.ret_ty.fields) if hasattr(main.ret_ty, "fields") else 1
    return split, sites, params, out_spec, n_outputs


def check_device(target, inputs) -> None:
    """The sample inputs live where the target's code runs: DLPack hands TVM PyTorch's memory as it
    is, so CPU tensors for a GPU build (or the reverse) would reach its kernels on the wrong device."""
    wanted = "cuda" if target.is_gpu else "cpu"  # PyTorch names ROCm's device "cuda" too
    found = sorted({t.device.type for t in inputs})
    if found != [wanted]:
        raise InputError(f"add_tvm_dispatch: target {target.key} runs on {target.device_type}, and the sample inputs are on "
                         f"{', '.join(found)}: move the module and its inputs there (module.to('{wanted}'))")


def compile_module(forward, module, inputs, target, log_dir: Path) -> Compiled:
    import tvm
    from tvm import relax

    from tvmbert.tuning.compile import compile_tuned

    split, sites, params, out_spec, n_outputs = training_module(forward, module, inputs)
    compiled = compile_tuned(lowering(ENTRIES)(split.module), target, log_dir, to_stderr, ENTRIES, label=type(module).__name__)
    device = tvm.device(target.device_type, inputs[0].device.index or 0)  # torch's "cuda" is TVM's rocm on ROCm
    vm = relax.VirtualMachine(compiled.executable, device)
    param_signature = Signature.of([_lookup(module, name) for name in params])
    return Compiled(vm, sites, params, param_signature, len(inputs), n_outputs, out_spec, split, len(compiled.tasks),
                    compiled.untuned)


def job_layer(job):
    """The job's first encoder layer in train mode, fed what it sees in the model: the hidden
    states the model hands it for the job's example input (after the embeddings, and ALBERT's
    projection of them), and the additive attention mask."""
    import torch

    from tvmbert.core.config import torch_dtype
    from tvmbert.core.families import FAMILIES
    from tvmbert.frontend import models

    if job.config.dtype not in ("float32", "float64"):
        raise InputError(f"training runs in float32 or float64, not {job.config.dtype}")
    if why := FAMILIES[job.source.family].layer_not_alone:
        raise InputError(f"--train compiles an encoder layer alone from its hidden states and mask; {job.source.family}'s "
                         f"cannot be ({why}): not supported yet")
    wrapped = models.load(job.source, torch_dtype(job.config.dtype), job.config.seed)
    layer = FAMILIES[job.source.family].layers(wrapped.model.base_model)[0]
    seen = []
    hook = layer.register_forward_pre_hook(lambda module, args, kwargs: seen.append(args[0] if args else kwargs["hidden_states"]),
                                           with_kwargs=True)
    try:
        with torch.no_grad():
            wrapped(*job.inputs.as_tuple())
    finally:
        hook.remove()
    hidden = seen[0]
    mask = (1.0 - job.inputs.attention_mask[:, None, None, :].to(hidden.dtype)) * torch.finfo(hidden.dtype).min
    return layer.train(), (hidden.detach(), mask)


def layer_tasks(job) -> list[Task]:
    """The forward and backward kernels ``add_tvm_dispatch`` compiles for the job's layer."""
    layer, inputs = job_layer(job)
    split, *_ = training_module(layer.forward, layer, inputs)
    return extract_tasks(lowering(ENTRIES)(split.module), job.target, ENTRIES)


def saved_activation_bytes(module, inputs) -> int:
    """Bytes autograd keeps from one forward for its backward, beyond the parameters and inputs
    (which are held anyway): measured the same way for PyTorch's own forward and for TVM's."""
    import torch

    held = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers(), *inputs)}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in held:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = module(*inputs)
    del output
    return sum(storages.values())
