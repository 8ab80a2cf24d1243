"""Pictures of encoder layer 0: the Relax dataflow graph as Graphviz DOT, rendered to SVG.

In the spirit of the seed post's ``visualize()``: operators with their attributes, small
constants inline, weights as boxes with shape and dtype. The layer is found by position: in
every family (BERT, DistilBERT, ALBERT, ...) an encoder layer holds two layer norms and the
embeddings one, so layer 0 is what lies after the first layer norm up to and including the
third, before and after any pass.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tvmbert.core.artifacts import write_text

SMALL_CONSTANT = 8  # constants with at most this many elements are drawn inline


def _op_name(value) -> str | None:
    from tvm import relax

    if not isinstance(value, relax.Call):
        return None
    name = getattr(value.op, "name", None) or getattr(value.op, "name_hint", "call")
    if name == "relax.call_tir":
        return "tir:" + value.args[0].name_hint
    return name.removeprefix("relax.")


def _layer_bindings(function) -> list:
    bindings = [b for block in function.body.blocks for b in block.bindings]
    norms = [i for i, b in enumerate(bindings) if "layer_norm" in (_op_name(b.value) or "")]
    if len(norms) < 3:
        return bindings  # not a BERT-shaped graph: draw all of it
    return bindings[norms[0] + 1 : norms[2] + 1]


def _shape(struct) -> str:
    shape = getattr(struct, "shape", None)
    dtype = getattr(struct, "dtype", "")
    dims = "x".join(str(int(d)) if hasattr(d, "value") else str(d) for d in shape) if shape is not None else "?"
    return f"{dims} {dtype}".strip()


def _attrs(value) -> str:
    attrs = getattr(value, "attrs", None)
    if attrs is None:
        return ""
    parts = []
    for key in getattr(attrs, "keys", lambda: [])():
        item = attrs[key]
        text = str(item)
        if len(text) <= 24 and key not in ("out_dtype",):
            parts.append(f"{key}={text}")
    return "\\n".join(parts[:3])


def to_dot(module, title: str) -> str:
    """DOT of layer 0 of ``main``."""
    from tvm import relax

    function = module["main"]
    region = _layer_bindings(function)
    produced = {b.var: f"n{i}" for i, b in enumerate(region)}
    lines = [f'digraph "{title}" {{', '  rankdir=TB; node [fontname="Helvetica", fontsize=10];',
             f'  label="{title}"; labelloc=t;']
    outside: dict = {}
    for binding in region:
        node = produced[binding.var]
        value = binding.value
        op = _op_name(value) or type(value).__name__
        detail = _attrs(value)
        label = f"{op}\\n{_shape(binding.var.ty)}" + (f"\\n{detail}" if detail else "")
        lines.append(f'  {node} [shape=ellipse, label="{label}"];')
        arguments = list(value.args) if isinstance(value, relax.Call) else list(getattr(value, "fields", []))
        if isinstance(value, relax.TupleGetItem):
            arguments = [value.tuple_value]
        if isinstance(value, relax.Call) and op.startswith("tir:"):
            arguments = list(value.args[1].fields) if isinstance(value.args[1], relax.Tuple) else [value.args[1]]
        for argument in arguments:
            if argument in produced:
                lines.append(f"  {produced[argument]} -> {node};")
            elif isinstance(argument, relax.Var):
                if argument not in outside:
                    key = f"v{len(outside)}"
                    outside[argument] = key
                    lines.append(f'  {key} [shape=box, style=filled, fillcolor="#dde8f5", '
                                 f'label="{argument.name}\\n{_shape(argument.ty)}"];')
                lines.append(f"  {outside[argument]} -> {node};")
            else:
                key = f"c{len(outside)}"
                outside[key] = argument
                data = argument.data.numpy() if hasattr(argument, "data") else None
                if data is not None and data.size > SMALL_CONSTANT:
                    lines.append(f'  {key} [shape=box, style=filled, fillcolor="#eeeeee", label="const\\n{_shape(argument.ty)}"];')
                else:
                    text = (str(data.tolist()) if data.ndim else repr(data.item())) if data is not None else str(argument)
                    lines.append(f'  {key} [shape=plaintext, label="{text[:30].replace(chr(34), chr(39))}"];')
                lines.append(f"  {key} -> {node};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render(module, title: str, path_stem: Path) -> Path:
    """Writes ``.dot`` and, when Graphviz's ``dot`` is installed, ``.svg``; returns what it wrote last."""
    dot_path = path_stem.with_suffix(".dot")
    write_text(dot_path, to_dot(module, title))
    dot = shutil.which("dot")
    if dot is None:
        return dot_path
    svg_path = path_stem.with_suffix(".svg")
    subprocess.run([dot, "-Tsvg", str(dot_path), "-o", str(svg_path)], check=True, capture_output=True)
    return svg_path
