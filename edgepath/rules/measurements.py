"""The registry's measured figures, each read from the record that measured it.

A path's decode on a CPU tier (``TierDecode``), its held-out perplexity increase
(``HeldOut``) and a phone program's fidelity and speed (``ProgramFidelity``) are looked
up in committed records, shipped with the package in ``edgepath/rules/measured/``,
never typed into code; the selector's rationales interpolate them. A figure a record
does not hold fails when the registry is built, and ``tests/test_measurements.py``
fails where a rationale cites a number no record holds.

=========================== ===============================================================
record                      what ran (its narrative and command: benchmarks/results/)
=========================== ===============================================================
``builds.json``             ``benchmarks/builds.py``; its ``compare`` part is the benchmark
                            stage's record on an AMD EPYC with AVX2 only (builds.md)
``engine_auto.json``        the benchmark stage's ``benchmark.json`` on an AMD EPYC Zen 4
                            (AVX512-BF16, VNNI, no AMX) (engine_auto.md)
``w4a8_vnni.json``          the same on the Zen 4 host with W4A8 through edgepath's VNNI
                            patch (w4a8_vnni.md)
``phone_xnnpack.json``      ``benchmarks/phone_xnnpack.py``: the XNNPACK programs in
                            ExecuTorch's runtime on an x86_64 AVX2 host, not a phone (phone.md)
=========================== ===============================================================
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

from ..core.errors import EdgepathError

MEASURED = Path(__file__).with_name("measured")
# Where in a record its benchmark-stage record sits: builds.json holds it as one part.
_BENCHMARK_AT = {"builds.json": ("parts", "compare", "result")}
Q4_K_M = "llama.cpp Q4_K_M"


@dataclasses.dataclass(frozen=True)
class TierDecode:
    """A path's batch-1 decode on one CPU kernel ISA tier (``HardwareProfile.kernel_isa``),
    with llama.cpp Q4_K_M's measured beside it in the same interleaved run: the ratio, not
    the tok/s, compares runs on different days and hosts of one tier. The selector's
    ``engine: auto`` compares paths by it."""

    tier: str
    tok_s: float
    vs_q4_k_m: float
    measured: str
    """What ran, where and when, and the record that holds it."""

    def __str__(self) -> str:
        return f"{self.tok_s:.1f} tok/s, {self.vs_q4_k_m:.2f}x llama.cpp Q4_K_M ({self.measured})"


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """A path's perplexity increase over bf16 on the held-out genres, scored in its own
    engine in one benchmark run: the mean, and the worst genre."""

    mean_increase_pct: float
    worst: str
    measured: str

    def __str__(self) -> str:
        return f"+{self.mean_increase_pct:.2f} % mean, worst {self.worst} ({self.measured})"


@dataclasses.dataclass(frozen=True)
class ProgramFidelity:
    """A phone program's measured fidelity and speed, run in ExecuTorch's runtime on a
    build host (x86_64, not a phone): teacher-forced top-1 agreement with the fp32
    model over the held-out genres, pooled and on the worst genre, and its batch-1
    decode there. The selector picks a phone CPU's program by it."""

    top1_vs_fp32: float
    worst_genre: str
    worst_top1: float
    decode_tok_s: float
    measured: str

    def __str__(self) -> str:
        return (f"top-1 {self.top1_vs_fp32:.3f} against fp32 over the held-out genres (worst: {self.worst_genre} "
                f"{self.worst_top1:.3f}), {self.decode_tok_s:.1f} tok/s ({self.measured})")


@functools.cache
def record(name: str) -> dict[str, Any]:
    """The committed record ``name`` (module docstring)."""
    path = MEASURED / name
    if not path.is_file():
        raise EdgepathError(f"{path}: no such measurement record; edgepath ships "
                            f"{', '.join(sorted(p.name for p in MEASURED.glob('*.json')))}")
    return json.loads(path.read_text())


def benchmark(name: str) -> dict[str, Any]:
    """The benchmark stage's record (``benchmark.json``) that ``name`` holds."""
    found = record(name)
    for key in _BENCHMARK_AT.get(name, ()):
        found = found[key]
    if found.get("kind") != "edgepath.benchmark":
        raise EdgepathError(f"{MEASURED / name}: holds no benchmark stage record")
    return found


def arm(name: str, arm_name: str) -> dict[str, Any]:
    """Arm ``arm_name`` (a path's name, or a control's: ``vllm bf16``, ``llama.cpp Q4_0``)
    of benchmark record ``name``."""
    found = [a for a in benchmark(name)["arms"] if a["name"] == arm_name]
    if len(found) != 1:
        raise EdgepathError(f"{MEASURED / name}: no arm {arm_name!r}")
    return found[0]


def where(name: str) -> str:
    """What ran for benchmark record ``name``, on what and when, and the record."""
    r = benchmark(name)
    host = r["host"]["summary"]
    return (f"benchmark stage, {host['cpu_model']} ({host['kernel_isa']}), {r['settings']['threads']} threads, "
            f"{r['date'][:10]}; edgepath/rules/measured/{name}")


def tier_decode(name: str, arm_name: str, what: str = "") -> TierDecode:
    """``arm_name``'s decode in benchmark record ``name``, against llama.cpp Q4_K_M's in the
    same run; ``what``: what ran, where it was not the path's own build."""
    r, measured, control = benchmark(name), arm(name, arm_name), arm(name, Q4_K_M)
    tok_s = measured["decode_tok_s"]["median"]
    ratio = (measured.get("ratios") or {}).get("decode_vs_llama_q4_k_m") or round(
        tok_s / control["decode_tok_s"]["median"], 2)
    return TierDecode(r["host"]["summary"]["kernel_isa"], tok_s, ratio, f"{what}{where(name)}")


def held_out(name: str, arm_name: str) -> HeldOut:
    """``arm_name``'s perplexity increase over bf16 on the held-out genres in benchmark
    record ``name``."""
    fidelity, settings = arm(name, arm_name)["fidelity"], benchmark(name)["settings"]
    worst = fidelity["worst"]
    return HeldOut(fidelity["mean_increase_pct"], f"{worst['genre']} +{worst['increase_pct']:.2f} %",
                   f"{settings['windows']} x {settings['length']} held-out tokens per genre, each in its own "
                   f"engine; {where(name)}")


def program(name: str, program_name: str) -> ProgramFidelity:
    """Phone program ``program_name``'s fidelity against fp32 and decode in record ``name``
    (``benchmarks/phone_xnnpack.py``'s)."""
    r = record(name)
    p = r["programs"][program_name]
    fidelity, host = p["fidelity_against_fp32"], r["host"]
    return ProgramFidelity(
        fidelity["top1_agreement"], fidelity["worst"]["genre"], fidelity["worst"]["top1_agreement"],
        p["decode_tok_s"]["median"],
        f"ExecuTorch's runtime on an {host['cpu_model']} ({host['kernel_isa']}), not a phone, "
        f"{r['threads']} threads, {len(r['held_out']['genres'])} genres x {r['held_out']['tokens_per_genre']} "
        f"held-out tokens, {r['date']}; edgepath/rules/measured/{name}")
