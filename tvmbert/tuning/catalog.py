"""Every CPU's tuning database in the log roots (the user's, then the shipped one), and which one a
kernel's schedule comes from.

MetaSchedule looks a record up by its workload alone (apache/tvm#15549): a schedule tuned on one
CPU applies verbatim to the same kernel built for another, and its code is generated for the
build's own CPU. So when this CPU's database has no record for a kernel, the nearest other CPU's
best record is taken (AutoTVM's TopHub fell back to the device family the same way): same ISA
level (AVX-512, AVX2, ...) first, then same vendor, then the most shared features; another
architecture never. A record that tensorizes with an instruction this CPU lacks is never taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tvmbert.core import targets
from tvmbert.ir.tasks import extract_tasks, marked_kernels, without_marks
from tvmbert.tuning import database

NATIVE = "native"
DEFAULT = "default"
TRANSFERRED = "transferred from "

# Tensor intrinsics MetaSchedule may tensorize a CPU record with, and the LLVM features each needs.
# A record naming an intrinsic missing here is never transferred.
INTRINSIC_FEATURES = {
    "dot_16x4_vnni": {"avx512vnni"},
    "dot_16x4_avx512": {"avx512bw"},
    "dot_4x4_i8i8s32_neon": {"neon"},
    "dot_4x4_i8i8s32_sdot": {"dotprod"},
    "dot_4x4_u8u8u32_udot": {"dotprod"},
    "dot_4x4_u8u8i32_hdot": {"dotprod"},
}
ISA_LEVELS = (("avx512f", "avx512"), ("avx2", "avx2"), ("sse4.2", "sse4"), ("sve", "sve"), ("neon", "neon"))
TRIPLES = ("x86_64-linux-gnu", "aarch64-linux-gnu")
AMD_CPUS = ("znver", "bdver", "btver", "amdfam")


@dataclass(frozen=True)
class Cpu:
    """What a database's CPU is, as far as records carrying across CPUs care."""

    key: str
    arch: str
    vendor: str
    isa: str
    features: frozenset

    def distance(self, other: Cpu) -> tuple | None:
        """How far ``other``'s records are from fitting this CPU; None: they never fit."""
        if other.arch != self.arch:
            return None
        shared = len(self.features & other.features) / max(len(self.features | other.features), 1)
        return (other.isa != self.isa, other.vendor != self.vendor, -shared)


@cache
def describe(key: str) -> Cpu | None:
    """The CPU a database key names (``llvm-<mcpu>``, less or more the instruction sets the key
    says: ``targets.llvm_key``), from LLVM's own CPU tables; None when LLVM knows no such CPU."""
    import tvm
    from tvm.target import codegen

    config = targets.cpu_of_key(key)
    if config is None:
        return None
    mcpu = config["mcpu"]
    for triple in TRIPLES:
        if codegen.llvm_is_valid_cpu(mcpu, triple):
            target = tvm.target.Target({**config, "mtriple": triple})
            features = frozenset(str(name) for name in codegen.llvm_get_cpu_features(target))
            isa = next((level for feature, level in ISA_LEVELS if feature in features), "base")
            vendor = "amd" if mcpu.startswith(AMD_CPUS) else "arm" if triple.startswith("aarch64") else "intel"
            return Cpu(key, triple.split("-")[0], vendor, isa, features)
    return None


def tensor_intrinsics(record) -> set[str]:
    """The tensor intrinsics a record's schedule tensorizes with."""
    found = set()
    for inst in record.trace.insts:
        if inst.kind.name == "Tensorize":
            found.add(str(inst.attrs[0]))
        elif inst.kind.name == "Annotate" and str(inst.attrs[0]) == "meta_schedule.auto_tensorize":
            found.add(str(inst.inputs[1]))
    return found


def fits(record, cpu: Cpu) -> bool:
    """Whether every instruction the record's schedule tensorizes with exists on ``cpu``."""
    return all(name in INTRINSIC_FEATURES and INTRINSIC_FEATURES[name] <= cpu.features for name in tensor_intrinsics(record))


@dataclass
class Source:
    key: str
    database: object  # database's LogDatabase

    def label(self, native_key: str) -> str:
        return NATIVE if self.key == native_key else TRANSFERRED + self.key


class Catalog:
    """This target's databases first (the user's ``log_dir``, then the shipped one), then, on CPUs,
    the other CPUs' databases under the same log roots, nearest first (at the same distance, the
    user's before the shipped)."""

    def __init__(self, log_dir: Path, target_key: str, warn, live: bool = False, cores: int | None = None):
        self.key = target_key
        self.cores = cores  # records measured at this core count come first: their parallel extents fit it
        self.native = Source(target_key, database.open_database(log_dir, warn=warn, live=live))
        roots = database.log_roots(log_dir.parent)
        self.expected = [root / target_key for root in roots]  # this target's folders, there or not
        self.others: list[Source] = [Source(target_key, database.open_database(folder, warn=warn))
                                     for folder in self.expected[1:] if database.holds_records(folder)]
        self.cpu = describe(target_key)
        if self.cpu is None:
            return
        ranked = []
        for order, root in enumerate(roots):
            for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name != target_key) if root.is_dir() else []:
                other = describe(folder.name)
                distance = self.cpu.distance(other) if other is not None else None
                if distance is not None and database.holds_records(folder):
                    ranked.append(((distance, order), folder))
        self.others += [Source(folder.name, database.open_database(folder, warn=warn))
                        for _, folder in sorted(ranked, key=lambda item: item[0])]

    @property
    def sources(self) -> list[Source]:
        return [self.native, *self.others]

    def records(self, source: Source, mod) -> list:
        """``source``'s records of a workload that ran and fit this CPU, best first; those
        measured at this machine's core count before the others."""
        found = database.valid_records(source.database, mod)
        if source is not self.native and self.cpu is not None:
            found = [r for r in found if fits(r, self.cpu)]
        return sorted(found, key=lambda r: self.cores is not None and measured_cores(r) != self.cores)

    def measured_here(self, mod) -> bool:
        """Whether this CPU's databases hold a record of ``mod`` measured at this core count."""
        return any(measured_cores(r) == self.cores for source in self.sources if source.key == self.key
                   for r in database.valid_records(source.database, mod))

    def nearest(self, mods) -> Source | None:
        """The nearest database holding a usable record for any of ``mods``."""
        return next((s for s in self.sources if any(self.records(s, mod) for mod in mods)), None)

    def database_of(self, chosen: dict) -> object:
        """An in-memory database holding, per workload, the best record of the source chosen for it."""
        from tvm.s_tir import meta_schedule as ms

        merged = ms.database.MemoryDatabase(module_equality="structural")
        for mod, source in chosen.items():
            best = self.records(source, mod)[:1]
            if best:
                workload = merged.commit_workload(mod)
                merged.commit_tuning_record(ms.database.TuningRecord(
                    best[0].trace, workload, best[0].run_secs, best[0].target, best[0].args_info))
        return merged

    def read(self) -> list[str]:
        """Every database a build looked records up in (its fingerprint covers them all)."""
        return [str(s.database.log_dir) for s in self.sources if s.database.log_dir.is_dir()]

    def missing(self) -> list[str]:
        """This target's folders that do not exist: nothing tuned here yet, or no records ship for it."""
        return [str(folder) for folder in self.expected if not folder.is_dir()]

    def prefer_measured_layouts(self, module, target):
        """Keeps each kernel's weights as they are where records measured that way (tuned before
        a weight layout of its own, or for a shape where it does not pay: compute-bound matmuls already keep their
        weight tiles in cache) run faster than the laid-out ones. Both are read from the nearest
        database that measured either: times from two CPUs do not compare."""
        marked = marked_kernels(module)
        if not marked:
            return module
        packed = {t.name: t.module for t in extract_tasks(module, target) if t.name in marked}
        plain = {t.name: t.module for t in extract_tasks(without_marks(module, marked), target)
                 if t.name in marked}
        slower = set()
        for name, mod in packed.items():
            source = self.nearest([mod, plain[name]]) if name in plain else None
            if source is not None:
                packed_s, plain_s = (database.mean_seconds(self.records(source, m)) for m in (mod, plain[name]))
                if plain_s is not None and (packed_s is None or plain_s < packed_s):
                    slower.add(name)
        return without_marks(module, slower) if slower else module

    def schedules(self, tasks) -> tuple[dict, object]:
        """Per task, where its schedule comes from (native, transferred from KEY, default), and
        the database holding those records."""
        chosen = {t.name: self.nearest([t.module]) for t in tasks}
        database = self.database_of({t.module: chosen[t.name] for t in tasks if chosen[t.name] is not None})
        return {name: source.label(self.key) if source else DEFAULT for name, source in chosen.items()}, database


def measured_cores(record) -> int | None:
    cores = record.target.attrs.get("num-cores")
    return int(cores) if cores is not None else None
