"""The manifest: every target of the fleet, its weight path, why, and its artifacts.

Built from the model record, one selection record per target (in the fleet's
order), the quantize stage's checkpoints, the patch-verify records and the
benchmark record; validated against ``schemas/manifest.schema.json`` when
written and when read.

A target's ``verification.verified`` comes from records only, never from
prose: it is true only where its build ran on hardware of its kind and matched
its reference, i.e. where this pipeline's patch-verify record stands for the
target (``coverage.why_host_does_not_stand_for``: the build host's kernel ISA tier), that
record's verdict, or else where an imported benchmark record (with its host
digest, date and versions) of a host of the target's tier measured the path,
which it does only after patch-verify passed there. A phone's program is
checked on the build host (``checked off-device``), which is not a phone, so it
stays unverified. Which stage built a target's artifact is its path's
``built_by`` (``weight_paths.Stage``). A phone whose program cannot be lowered
here (QNN without Qualcomm's SDK) has its path's fallback build beside it.

Each artifact has a ``name``, its place in the device's build directory (the
bundle, a pull); each target's ``release`` says which version (``releases.json``,
``edgepath release``) its build's content is, or that it is unreleased.

``render`` (``manifest show``) prints the record's strings through ``command.printable``: a
manifest is input like any other, and its text must not drive the terminal.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from .. import __version__
from ..core import records
from ..core.command import Command, printable
from ..core.errors import EdgepathError
from ..core.files import sha256_file
from ..rules import coverage, memory, versions
from ..rules.fleet import Params
from ..paths import of as family
from ..rules.weight_paths import Stage
from ..scoring.fidelity import COMPARED_CONTROLS

EXPORT_RECORD = records.FILE_NAMES["export"]


def _present(path: Path) -> bool:
    """Whether a stage has left something at ``path``: a record that is missing means
    the stage has not run; anything else there (a directory, a FIFO, a broken link) is
    read, and refused by name, rather than taken for a stage that has not run."""
    return os.path.lexists(path)


def _relative(path: Path, base: Path) -> str:
    try:
        return path.resolve().relative_to(base.resolve()).as_posix()
    except ValueError:
        return str(path.resolve())


def _artifact(path: Path, base: Path, output_parent: Path) -> dict[str, Any]:
    """A file of a stage output: its project path, and its ``name`` in a device's
    build (relative to the folder above the stage output: ``<path>/config.json``)."""
    return {"path": _relative(path, base), "name": path.relative_to(output_parent).as_posix(),
            "size": path.stat().st_size, "sha256": sha256_file(path)}


def _quantization_summary(report: dict[str, Any], engine_check: dict[str, Any]) -> dict[str, Any]:
    return {
        "group_size": report["format"]["group_size"],
        "group_size_reason": report["format"]["group_size_reason"],
        "bits_per_weight": report["bits_per_weight"],
        "head": report["head"]["stored"],
        "search": report["algorithm"]["search"],
        "calibration": {k: report["calibration"][k] for k in ("corpus", "samples", "length", "chat_samples")},
        "perplexity": _quantize_fidelity(report["fidelity"]),
        "engine_check": engine_check,
    }


def _quantize_fidelity(fidelity: dict[str, Any]) -> dict[str, Any] | None:
    """The quantize stage's held-out perplexity, the dequantized checkpoint's against
    the model's in transformers: per genre, the mean increase and the worst genre; None
    where it was not measured."""
    if not fidelity.get("genres"):
        return None
    return {"genres": {g: {"reference": f["perplexity_reference"], "quantized": f["perplexity_quantized"],
                           "increase_pct": f["increase_pct"]} for g, f in fidelity["genres"].items()},
            "mean_increase_pct": fidelity["mean_increase_pct"], "worst": fidelity["worst"]}


def _build(selection: dict[str, Any], model_record: dict[str, Any], model_dir: Path, weights_dir: Path,
           export: dict[str, Any] | None, exports_dir: Path, base: Path):
    """(build state, artifacts, quantization summary or None) of one target; ``export``:
    its export record, where its path is an export that was built."""
    stage = Stage(selection["path"]["built_by"])
    if stage is Stage.MODEL:
        artifacts = [
            {"path": _relative(model_dir / f["path"], base), "name": f"{model_dir.name}/{f['path']}",
             "size": f["size"], "sha256": f["sha256"]}
            for f in model_record["files"]
        ]
        return {"state": "built", "detail": "the model stage's checkpoint, unquantized"}, artifacts, None
    name = selection["path"]["name"]
    built = weights_dir / name
    report_file = built / records.FILE_NAMES["quantization"]
    if stage is Stage.QUANTIZE and _present(report_file):
        report = records.read(report_file, "quantization")
        if report["model"]["fingerprint"] != model_record["fingerprint"]:
            raise EdgepathError(f"{built}: quantized from another model (fingerprint differs); re-run quantize@{name}")
        path_family = family(name)
        kind = path_family.check_kind
        summary = path_family.check_summary(records.read(built / records.FILE_NAMES[kind], kind))
        artifacts = [_artifact(f, base, weights_dir) for f in sorted(built.iterdir()) if f.is_file()]
        checked = (f"engine check not run on the build host: {summary['not_run']}" if summary["not_run"]
                   else f"{summary['engine']} check {'passed' if summary['passed'] else 'FAILED'}")
        return ({"state": "built", "detail": f"quantize@{name}: {report['format']['quant_method']} checkpoint, "
                 f"{checked}"},
                artifacts, _quantization_summary(report, summary))
    if export is not None:
        artifacts = _export_artifacts(exports_dir / name, export, base)
        return {"state": "built", "detail": family(name).export_detail(export)}, artifacts, None
    return {"state": "pending", "detail": (f"built by the {stage.value} stage; {stage.value}@{name} has no complete "
                                           f"output here (not in {stage.value}.paths in params.yaml, not run yet, "
                                           f"or interrupted)")}, [], None


def export_record(selection: dict[str, Any], exports_dir: Path, model_record: dict[str, Any]) -> dict[str, Any] | None:
    """The export record of the target's path, or None (not an export path, or not built)."""
    path = selection["path"]
    return _read_export(path["name"], exports_dir, model_record) if path["built_by"] == Stage.EXPORT.value else None


def _read_export(name: str, exports_dir: Path, model_record: dict[str, Any]) -> dict[str, Any] | None:
    """export@``name``'s record, for this model; None where that stage has not run."""
    directory = exports_dir / name
    if not _present(directory / EXPORT_RECORD):
        return None
    record = records.read(directory / EXPORT_RECORD, "export")
    if record["model"]["fingerprint"] != model_record["fingerprint"]:
        raise EdgepathError(f"{directory}: exported from another model (fingerprint differs); "
                            f"re-run export@{record['path']}")
    return record


def _export_artifacts(directory: Path, record: dict[str, Any], base: Path) -> list[dict[str, Any]]:
    files = [{**f, "path": _relative(directory / f["path"], base), "name": f"{directory.name}/{f['path']}"}
             for f in record["files"]]
    return [*files, _artifact(directory / EXPORT_RECORD, base, directory.parent)]


def _export_summary(selection: dict[str, Any], record: dict[str, Any], exports_dir: Path,
                    model_record: dict[str, Any], base: Path) -> dict[str, Any]:
    """A phone target's program (``record``): its precision, calibration, parity and .pte
    state, and where the .pte cannot be built here, the fallback build the device runs
    meanwhile."""
    path = selection["path"]
    summary = {"program": record["program"], "calibration": record["calibration"], "parity": record["parity"],
               "pte": record["pte"], "generation": record["generation"],
               **({"runtime_check": record["runtime_check"]} if "runtime_check" in record else {})}
    fallback = path["fallback"]
    if record["pte"]["state"] == "built" or fallback is None:
        return summary
    other = _read_export(fallback, exports_dir, model_record)
    if other is None:
        return {**summary, "fallback": {"path": fallback, "state": "pending",
                                        "detail": f"add {fallback} to export.paths in params.yaml", "artifacts": []}}
    return {**summary, "fallback": {
        "path": fallback, "state": "built",
        "detail": (f"until {path['name']}'s .pte is lowered ({record['pte']['detail']}), the device runs "
                   f"{fallback} on its CPU: {family(fallback).export_detail(other)}"),
        "artifacts": _export_artifacts(exports_dir / fallback, other, base)}}


# The files of a build that hold its weights (the rest: configs, tokenizers, records).
_WEIGHT_FILES = (".safetensors", ".gguf", ".pte")


def _memory(selection: dict[str, Any], artifacts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The selection's memory need against the device's, its weights counted from the
    built artifact where there is one (the selection could only estimate them)."""
    need = selection["path"]["memory"]
    weights = [a for a in artifacts if a["name"].endswith(_WEIGHT_FILES)]
    if need is None or not weights:
        return need
    return memory.with_built_weights(need, sum(a["size"] for a in weights),
                                     f"the built {', '.join(a['name'] for a in weights)}")


def _verification(selection: dict[str, Any], verify_dir: Path, export: dict[str, Any] | None,
                  imported: list[tuple[str, dict[str, Any]]], base: Path) -> dict[str, Any]:
    """Whether the target's build ran on hardware of its kind and matched its reference,
    from records only: this pipeline's patch-verify record where its host stands for
    the target (``coverage.why_host_does_not_stand_for``), else an imported benchmark
    record of a host that does (the benchmark measures a path only after patch-verify passed there);
    a phone's program from its export record, which is checked off-device."""
    path, target = selection["path"], selection["profile"]["summary"]
    name = path["name"]
    if export is not None:
        return {"verified": False, "record": None, **family(name).verification(export)}
    if path["built_by"] != Stage.QUANTIZE.value:
        device = target["gpu_name"] or target["accelerator"] if target["accelerator"] != "none" else target["arch"]
        return {"verified": False, "record": None, "state": "not run here",
                "detail": (f"nothing of this device's kind ({device}) ran {name} in this pipeline: patch-verify runs the "
                           f"quantize stage's CPU builds, and {name} is built by the {path['built_by']} stage")}
    record_path = verify_dir / f"{name}.json"
    record = records.read(record_path, "patch_verify") if _present(record_path) else None
    reference = {"record": _relative(record_path, base) if record else None}
    if record is None:
        why = f"patch-verify@{name} has not run (add {name} to quantize.paths)"
    elif record["not_run"]:
        why = f"patch-verify did not run {name} on the build host: {record['not_run']}"
    else:
        why = coverage.why_host_does_not_stand_for(record["host"]["summary"], target)
    if why is None:
        return _patch_verified(record, reference)
    for file, other in imported:
        there = other["host"]["summary"]
        if (other["paths"].get(name, {}).get("state") == "measured"
                and coverage.why_host_does_not_stand_for(there, target) is None):
            return {"verified": True, "record": file, "state": "imported", "run": _provenance(file, other),
                    "detail": (f"patch-verify passed on {there['cpu_model'] or there['arch']} ({there['kernel_isa']}) "
                               f"before its benchmark of {other['date'][:10]} measured {name} there; imported from "
                               f"{file}")}
    return {"verified": False, **reference, "state": "not run here", "detail": why}


def _patch_verified(record: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    host = record["host"]["summary"]
    where = f"on the build host ({host['cpu_model'] or host['arch']}, {host['kernel_isa']})"
    patches = {name: p["state"] for name, p in record["patches"].items()}
    if not record["passed"]:
        return {"verified": False, **reference, "state": "failed", "patches": patches,
                "detail": f"patch-verify {where}: {'; '.join(record['failures'])}"}
    return {"verified": True, **reference, "state": "passed", "patches": patches,
            "detail": family(record["path"]).verified_detail(record, where)}


def measurement(selection: dict[str, Any], record: dict[str, Any],
                imported: list[tuple[str, dict[str, Any]]]) -> tuple[str, dict[str, Any] | None, str]:
    """(state, arm or None, detail) of one target: its build measured here (the record's
    host stands for the target, ``coverage.why_host_does_not_stand_for``), imported from
    a record of a host that does (``imported``: (file, record) pairs), or not measured here, with
    why. Arms carry the provenance of the run they came from."""
    path, summary = selection["path"], selection["profile"]["summary"]
    host = record["host"]["summary"]
    elsewhere = coverage.why_host_does_not_stand_for(host, summary)
    if summary["accelerator"] != "none":  # no CPU benchmark stands for it, here or imported
        return "not measured here", None, elsewhere
    if path["built_by"] != Stage.QUANTIZE.value:
        return "not measured here", None, f"{path['name']} is not a CPU build of the quantize stage"

    def arm_of(r: dict[str, Any]) -> dict[str, Any] | None:
        return next((a for a in r["arms"] if a["role"] == "build" and a["name"] == path["name"]), None)

    arm = arm_of(record)
    if arm is not None and elsewhere is None:
        return "measured", {**arm, "provenance": _provenance(None, record)}, \
            f"{path['name']} measured on this host, whose CPU runs the target's kernels ({host['kernel_isa']})"
    for file, other in imported:
        arm_there, there = arm_of(other), other["host"]["summary"]
        if arm_there is not None and coverage.why_host_does_not_stand_for(there, summary) is None:
            return "imported", {**arm_there, "provenance": _provenance(file, other)}, \
                (f"measured on {there['cpu_model'] or there['arch']} ({there['kernel_isa']}) on "
                 f"{other['date'][:10]}, imported from {file}")
    if arm is None:
        return "not measured here", None, record["paths"].get(path["name"], {}).get(
            "detail", f"{path['name']} is not among the benchmarked paths (quantize.paths)")
    return "not measured here", None, elsewhere


def _provenance(file: str | None, record: dict[str, Any]) -> dict[str, Any]:
    return {"record": file, "date": record["date"], "host_digest": record["host"]["digest"],
            "versions": record["versions"]}


def _benchmark(selection: dict[str, Any], record: dict[str, Any] | None, record_path: Path,
               imported: list[tuple[str, dict[str, Any]]], export: dict[str, Any] | None,
               base: Path) -> dict[str, Any]:
    """A target's headline figures from the benchmark (``measurement``), with the
    run's date, host digest and versions, the measuring host's where imported; or why
    there are none (with a phone program's decode on the build host, where it ran)."""
    if record is None:
        return {"state": "not run", "detail": "the benchmark stage has not run", "record": None}
    reference = {"record": _relative(record_path, base)}
    state, arm, detail = measurement(selection, record, imported)
    if arm is None:
        check = (export or {}).get("runtime_check")
        if check is not None:
            detail += (f"; off-device, its .pte decoded {check['decode_tok_s']['median']:.1f} tok/s on "
                       f"{check['threads']} threads of the build host's CPU (export record)")
        return {"state": state, **reference, "detail": detail}
    fid = arm["fidelity"]
    run = arm["provenance"]
    return {"state": state, **reference, "detail": detail, "arm": arm["name"],
            "figures": {"decode_tok_s": arm["decode_tok_s"]["median"],
                        "decode_tok_s_range": [arm["decode_tok_s"]["min"], arm["decode_tok_s"]["max"]],
                        "prefill_tok_s": arm["prefill_tok_s"]["median"],
                        "cold_start_s": arm["start"]["cold_s"], "warm_start_s": arm["start"]["warm_s"],
                        "rss_anon_bytes": arm["memory"]["rss_anon_after_start_bytes"],
                        "rss_anon_peak_bytes": arm["memory"]["rss_anon_peak_bytes"],
                        "mean_increase_pct": fid["mean_increase_pct"], "worst": fid["worst"],
                        "increase_pct": {g: f["increase_pct"] for g, f in fid["genres"].items()},
                        "top1_vs_bf16": fid["top1_vs_bf16"],
                        "prompts_reproduced": fid["prompts_reproduced"], "prompts": fid["prompts"]},
            "ratios": arm["ratios"],
            "run": {**run, "record": run["record"] or reference["record"]}}


def target_metrics(manifest: dict[str, Any]) -> dict[str, Any]:
    """Each target's headline figures and ratios, for ``dvc metrics``."""
    metrics = {}
    for t in manifest["targets"]:
        b = t["benchmark"]
        if "figures" in b:
            f, r = b["figures"], b["ratios"]
            metrics[t["tag"]] = {"decode_tok_s": f["decode_tok_s"], "prefill_tok_s": f["prefill_tok_s"],
                                 "mean_increase_pct": f["mean_increase_pct"], "worst_genre": f["worst"]["genre"],
                                 "worst_increase_pct": f["worst"]["increase_pct"],
                                 "prompts_reproduced": f["prompts_reproduced"],
                                 "decode_vs_bf16": r["decode_vs_bf16"],
                                 "decode_vs_llama_q4_k_m": r["decode_vs_llama_q4_k_m"],
                                 **{f"increase_vs_{key}": r[key]["increase_ratio"]
                                    for key in COMPARED_CONTROLS if r.get(key)}}
        elif "export" in t:  # a phone: its program against fp32, and its decode off-device
            parity, check = t["export"]["parity"], t["export"].get("runtime_check")
            metrics[t["tag"]] = {"top1_vs_fp32": parity["top1_agreement"], "kl_vs_fp32": parity["kl_nats"],
                                 "logit_sqnr_db": parity["logit_sqnr_db"],
                                 **({"worst_genre_top1_vs_fp32": parity["worst"]["top1_agreement"]}
                                    if "worst" in parity else {}),
                                 **({"off_device_decode_tok_s": check["decode_tok_s"]["median"],
                                     "off_device_prefill_tok_s": check["prefill_tok_s"]["median"]} if check else {})}
    return metrics


def stage_costs(model: Path, calibration: Path, weights_dir: Path, verify_dir: Path, exports_dir: Path,
                control: Path, benchmark: Path) -> dict[str, dict[str, float]]:
    """Each stage's wall time and peak memory, as its record carries them (``usage.cost``),
    for ``dvc metrics``: DVC's stage name -> ``wall_time_s`` and ``peak_rss_gib``. A stage
    whose record is absent (not run, or not in this fleet) or carries no cost (written
    before stages recorded theirs) is left out."""
    found = [("model", model, "model"), ("calibrate", calibration, "calibration")]
    found += [(f"quantize@{p.parent.name}", p, "quantization")
              for p in sorted(weights_dir.glob(f"*/{records.FILE_NAMES['quantization']}"))]
    found += [(f"patch_verify@{p.stem}", p, "patch_verify") for p in sorted(verify_dir.glob("*.json"))]
    found += [(f"export@{p.parent.name}", p, "export") for p in sorted(exports_dir.glob(f"*/{EXPORT_RECORD}"))]
    found += [("control", control, "control"), ("benchmark", benchmark, "benchmark")]
    costs = {}
    for stage, path, kind in found:
        record = records.read(path, kind) if path.is_file() else {}
        if "peak_rss_bytes" in record:  # records older than the stage's cost carry none
            costs[stage] = {"wall_time_s": record["wall_time_s"],
                            "peak_rss_gib": round(record["peak_rss_bytes"] / 2**30, 2)}
    return costs


def build(params: Params, model_record_path: str | os.PathLike, selections_dir: str | os.PathLike,
          out: str | os.PathLike, weights_dir: str | os.PathLike = "build/weights",
          verify_dir: str | os.PathLike = "build/verify",
          exports_dir: str | os.PathLike = "build/exports",
          benchmark_path: str | os.PathLike = "build/benchmark/benchmark.json",
          benchmark_imports: list[str] = (), releases_path: str | os.PathLike = versions.RELEASES) -> dict[str, Any]:
    """Gather the fleet into a manifest record and write it atomically to ``out``.
    ``benchmark_imports``: benchmark records measured on other hosts, for targets this
    host cannot measure; ``releases_path``: the versions released (``release``)."""
    model_record = records.read(model_record_path, "model")
    releases = versions.read_releases(releases_path)
    benchmark_path = Path(benchmark_path)
    benchmark = records.read(benchmark_path, "benchmark") if _present(benchmark_path) else None
    imported = [(str(f), records.read(f, "benchmark")) for f in benchmark_imports]
    for where, r in [(str(benchmark_path), benchmark), *imported]:
        if r is not None and r["model"]["fingerprint"] != model_record["fingerprint"]:
            raise EdgepathError(f"{where}: measured another model (fingerprint differs); re-run the benchmark")
    model_dir = records.model_directory(model_record_path, model_record)
    base = Path(out).parent
    targets = []
    for tag in params.targets:
        path = Path(selections_dir) / f"{tag}.json"
        selection = records.read(path, "selection")
        if selection["tag"] != tag:
            raise EdgepathError(f"{path}: holds target {selection['tag']!r}, expected {tag!r}")
        if selection["model"]["fingerprint"] != model_record["fingerprint"]:
            raise EdgepathError(f"{path}: selected for another model (fingerprint differs); re-run select@{tag}")
        exported = export_record(selection, Path(exports_dir), model_record)
        build_state, artifacts, quantization = _build(selection, model_record, model_dir, Path(weights_dir),
                                                      exported, Path(exports_dir), base)
        export = (None if exported is None
                  else _export_summary(selection, exported, Path(exports_dir), model_record, base))
        targets.append({
            "tag": tag,
            "platform": selection["platform"],
            "priority": selection["priority"],
            "engine": selection["engine"],
            "profile": selection["profile"],
            "path": selection["path"],
            "build": build_state,
            "verification": _verification(selection, Path(verify_dir), export, imported, base),
            "benchmark": _benchmark(selection, benchmark, benchmark_path, imported, export, base),
            "artifacts": artifacts,
            "memory": _memory(selection, artifacts),
            **({"quantization": quantization} if quantization else {}),
            **({"export": export} if export else {}),
        })
        targets[-1]["release"] = versions.state(targets[-1], releases)
    manifest = {
        **records.envelope("manifest"),
        "edgepath_version": __version__,
        "model": {k: model_record[k] for k in ("source", "architecture", "parameters", "fingerprint", "digest")},
        "targets": targets,
    }
    records.write(out, "manifest", manifest)
    return manifest


def _gib(n: int | None) -> str:
    return "-" if not n else f"{n / 2**30:.0f}G"


def _memory_cell(m: dict[str, Any] | None) -> str:
    """Need against have, as ``1.3/4G``; ``!`` where it does not fit."""
    if m is None:
        return "-"
    return f"{m['need_bytes'] / 2**30:.1f}/{_gib(m['have_bytes'])}" + ("" if m["fits"] else " !")


def _memory_line(m: dict[str, Any]) -> str:
    gib = 2**30
    runtime = (f"engine {m['runtime_bytes'] / gib:.2f} GiB ({m['runtime_measured']})" if m["runtime_measured"]
               else "the engine's own memory not measured here, not counted")
    return (f"{'needs' if m['fits'] else 'DOES NOT FIT: needs'} {m['need_bytes'] / gib:.2f} GiB of the device's "
            f"{m['have_bytes'] / gib:.2f} GiB {m['have']} ({m['need_bytes'] / m['have_bytes']:.0%}): weights "
            f"{m['weights_bytes'] / gib:.2f} GiB ({m['weights_from']}), KV cache {m['kv_cache_bytes'] / gib:.2f} GiB at "
            f"{m['context']} tokens, {runtime}")


def _verified_cell(verification: dict[str, Any]) -> str:
    if verification["state"] == "failed":
        return "FAILED"
    return ("yes" if verification["verified"] else "NO") + (" (here)" if verification["state"] == "passed" else "")


def _increase(mean: float, worst: dict[str, Any]) -> str:
    """A mean perplexity increase over the genres and the worst genre, as ``manifest show``
    prints them."""
    return f"{mean:+.1f} % mean, worst {worst['genre']} {worst['increase_pct']:+.1f} %"


def _benchmark_line(b: dict[str, Any]) -> str:
    if "figures" not in b:
        return f"{b['state']}: {b['detail']}"
    f, r = b["figures"], b["ratios"]

    def times(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    controls = "; ".join(f"llama.cpp {ftype} {_increase(r[key]['mean_increase_pct'], r[key]['worst'])}"
                         for key, ftype in COMPARED_CONTROLS.items() if r.get(key))
    reproduced = r["llama_q4_k_m_prompts_reproduced"]
    return (f"{b['state']} {b['run']['date'][:10]}: decode {f['decode_tok_s']:.1f} tok/s ({times(r['decode_vs_bf16'])} "
            f"vLLM bf16, {times(r['decode_vs_llama_q4_k_m'])} llama.cpp Q4_K_M), prefill {f['prefill_tok_s']:.0f} "
            f"tok/s, perplexity over bf16 on {len(f['increase_pct'])} held-out genres "
            f"{_increase(f['mean_increase_pct'], f['worst'])}{f' ({controls})' if controls else ''}, "
            f"{f['prompts_reproduced']}/{f['prompts']} prompts reproduced"
            f"{'' if reproduced is None else f' (Q4_K_M {reproduced})'}")


def _quantization_line(q: dict[str, Any]) -> str:
    """What the quantize stage calibrated on and its own held-out perplexity (the
    dequantized checkpoint against the model, in transformers)."""
    ppl, calibration = q["perplexity"], q["calibration"]
    measured = ("held-out perplexity not measured" if ppl is None else
                f"perplexity over the model's on {len(ppl['genres'])} held-out genres "
                f"{_increase(ppl['mean_increase_pct'], ppl['worst'])}")
    return (f"calibrated on {calibration['samples']} x {calibration['length']} tokens of {calibration['corpus']}; "
            f"{measured}")


def version_cell(release: dict[str, Any]) -> str:
    return release["version"] or ("-" if release["state"] == "not built" else "unreleased")


def table(rows: list[tuple[str, ...]]) -> list[str]:
    """``rows`` (the first is the header) as lines of left-aligned columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _source(source: dict[str, Any]) -> str:
    """Where the model came from, in a phrase: its package, its packaged name or its
    path, and the source's own quantization where it had one."""
    where = source.get("package") or (f"packaged:{source['name']}" if "name" in source else source.get("path"))
    return f"{where} ({source['quantization']})" if source.get("quantization") else str(where)


def render(manifest: dict[str, Any]) -> str:
    """The manifest as a table, then each target's rationale and notes, every string
    from the record made ``printable``."""
    manifest = printable(manifest)
    m = manifest["model"]
    lines = [
        f"model  {m['architecture']}, {m['parameters'] / 1e6:.1f}M parameters, "
        f"from {_source(m['source'])}",
        f"       fingerprint {m['fingerprint'][:19]}  digest {m['digest'][:19]}",
        "",
    ]
    header = ("TAG", "PLATFORM", "DEVICE", "PATH", "ENGINE", "GROUP", "BITS/W", "MEMORY", "VERIFIED", "BUILD",
              "VERSION")
    rows = [header]
    for t in manifest["targets"]:
        s, p = t["profile"]["summary"], t["path"]
        device = s["arch"] + ("" if s["accelerator"] == "none" else f" + {s['gpu_name'] or s['accelerator']}")
        rows.append((
            t["tag"], t["platform"], f"{device}, {s['n_physical']}c/{_gib(s['ram_total_bytes'])}",
            p["name"], p["engine"], str(p["group_size"] or "-"), f"{p['bits_per_weight']:.2f}",
            _memory_cell(t["memory"]), _verified_cell(t["verification"]),
            f"{t['build']['state']} ({len(t['artifacts'])} files)" if t["artifacts"] else t["build"]["state"],
            version_cell(t["release"]),
        ))
    lines += table(rows)
    for t in manifest["targets"]:
        lines += ["", f"{t['tag']}: {t['path']['rationale']}"]
        lines += [f"  - {note}" for note in t["path"]["notes"]]
        lines.append(f"  - build: {t['build']['detail']}")
        if t["memory"] is not None:
            lines.append(f"  - memory: {_memory_line(t['memory'])}")
        fallback = t.get("export", {}).get("fallback")
        if fallback:
            lines.append(f"  - meanwhile: {fallback['state']}: {fallback['detail']}")
        lines.append(f"  - verification: {t['verification']['state']}: {t['verification']['detail']}")
        if "quantization" in t:
            lines.append(f"  - quantize: {_quantization_line(t['quantization'])}")
        lines.append(f"  - benchmark: {_benchmark_line(t['benchmark'])}")
        lines.append(f"  - release: {t['release']['state']}: {t['release']['detail']}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the command

def _cmd_build(args: argparse.Namespace) -> None:
    import json

    from ..core import atomic
    from ..rules import fleet

    imports = fleet.namespace(args.params, "manifest").get("benchmark_imports") or []
    built = build(fleet.load(args.params), args.model, args.selections, args.out, args.weights,
                  args.verify, args.exports, args.benchmark, list(imports), args.releases)
    if args.metrics:
        atomic.write_text(args.metrics, json.dumps(target_metrics(built), indent=2) + "\n")
    if args.costs:
        costs = stage_costs(Path(args.model), Path(args.calibration), Path(args.weights), Path(args.verify),
                            Path(args.exports), Path(args.control), Path(args.benchmark))
        atomic.write_text(args.costs, json.dumps(costs, indent=2) + "\n")
    print(f"manifest: {len(built['targets'])} targets -> {args.out}")


def _cmd_show(args: argparse.Namespace) -> None:
    from ..core import files

    sys.stdout.write(render(records.read(files.path_of(args.manifest, "manifest"), "manifest")))


def _build_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--params", default="params.yaml")
    b.add_argument("--model", default="build/model/model.json")
    b.add_argument("--selections", default="build/selections")
    b.add_argument("--weights", default="build/weights", help="where quantize@<path> wrote its checkpoints")
    b.add_argument("--verify", default="build/verify", help="where patch-verify@<path> wrote its records")
    b.add_argument("--exports", default="build/exports", help="where export@<path> wrote its programs")
    b.add_argument("--benchmark", default="build/benchmark/benchmark.json", help="the benchmark record")
    b.add_argument("--releases", default="releases.json", help="the versions released (`edgepath release`)")
    b.add_argument("--metrics", help="also write each target's headline figures here (dvc metrics)")
    b.add_argument("--calibration", default="build/calibration/calibration.json", help="the calibrate stage's record")
    b.add_argument("--control", default="build/control/control.json", help="the control stage's record")
    b.add_argument("--costs", help="also write each stage's wall time and peak memory here (dvc metrics)")
    b.add_argument("--out", default="manifest.json")


def _show_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("manifest", nargs="?", default="manifest.json")


COMMAND = Command("manifest", "build or show the manifest", """\
    Build manifest.json from the model record and every target's selection,
    or show it as a table with each target's rationale.""", subcommands=(
    Command("build", "gather every target into manifest.json", """\
        Gather the model record and every target's selection into a manifest,
        validated against its JSON Schema and written atomically.""", _build_arguments, _cmd_build),
    Command("show", "print the manifest as a table", """\
        Print the manifest as a readable table, then each target's rationale.""", _show_arguments, _cmd_show),
))
