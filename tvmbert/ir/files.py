"""The IR files stages hand each other: the traced program and the Relax module; here so that
build, tune and training read them without importing the stage that wrote them (weights and
libraries are deploy/'s)."""

from __future__ import annotations

from tvmbert.core import artifacts

PROGRAM_FILE = "program.pt2"  # trace: the torch.export program
MODULE_FILE = "module.json"  # the exact IR, read back by the next stage
SCRIPT_FILE = "module.py"  # the same IR as TVMScript, for people


def save_module(module, folder) -> None:
    import tvm

    artifacts.write_text(folder / MODULE_FILE, tvm.ir.save_json(module))
    artifacts.write_text(folder / SCRIPT_FILE, module.script(show_meta=False))


def load_module(folder):
    import tvm

    return tvm.ir.load_json((folder / MODULE_FILE).read_text())
