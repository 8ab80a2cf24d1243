"""Table lookups that never read outside their table."""

from __future__ import annotations


def bounded_takes():
    """A module pass convert runs on every imported module, whatever pipeline follows (not in
    PASSES, where a chosen pipeline could leave it out). TVM 0.27's importer emits each table
    lookup (the embeddings, ``x[:, 0]``) as take in "fast" mode, which reads outside the table for
    an index past its end (a crash, or another tensor's bytes) and warns so at every build. These
    read NaN there from a float table, else its nearest row: one compare per index. Callers check
    the ids first anyway (``deploy/inputs.check_range``); this keeps the library itself in bounds."""
    import tvm
    from tvm import relax

    from tvmbert.passes.rewriters import call_rewrite_pass

    take = tvm.ir.Op.get("relax.take")

    def bounded(_builder, call):
        if call.op != take or call.attrs.mode != "fast":
            return call
        table = call.args[0]
        mode = "nan" if str(table.ty.dtype).startswith(("float", "bfloat")) else "clip"
        return relax.op.take(table, call.args[1], call.attrs.axis, mode=mode)

    return call_rewrite_pass("BoundedTakes", bounded)
