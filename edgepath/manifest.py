"""The manifest: every target of the fleet, its weight path, why, and its artifacts.

Built from the model record, one selection record per target (in the fleet's
order), the quantize stage's checkpoints, the patch-verify records and the
benchmark record; validated against ``schemas/manifest.schema.json`` when
written and when read.

A target's ``verification.verified`` is true only where its build ran on such
hardware and matched its reference: where a patch-verify record covers the
target (``patch_verify.covers_target``: same kernel ISA tier as the build
host), that record's verdict; elsewhere the selection's kernel evidence. A
phone's program is checked on the build host (``checked off-device``), which is
not a phone, so it stays unverified. A phone whose program cannot be lowered
here (QNN without Qualcomm's SDK) has its path's fallback build beside it.

Each artifact has a ``name``, its place in the device's build directory (the
bundle, a pull); each target's ``release`` says which version (``releases.json``,
``edgepath release``) its build's content is, or that it is unreleased.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from . import __version__, records, release
from .engine_check import CHECK_NAME
from .errors import EdgepathError
from .fleet import Params
from .hf_model import sha256_file
from .model import model_directory
from .benchmark import RECORD_KIND as BENCHMARK_KIND, for_target
from .export import RECORD_NAME as EXPORT_RECORD
from .patch_verify import RECORD_KIND as VERIFY_KIND, covers_target
from .quantize import REPORT_NAME

# Paths whose artifact is the model directory itself (nothing to quantize).
_BUILT_BY_MODEL_STAGE = "model"


def _relative(path: Path, base: Path) -> str:
    try:
        return path.resolve().relative_to(base.resolve()).as_posix()
    except ValueError:
        return str(path.resolve())


def _artifact(path: Path, base: Path, output_parent: Path) -> dict[str, Any]:
    """A file of a stage output: its project path, and its ``name`` in a device's
    build (relative to the folder above the stage output: ``w4a16-tinygemm/config.json``)."""
    return {"path": _relative(path, base), "name": path.relative_to(output_parent).as_posix(),
            "size": path.stat().st_size, "sha256": sha256_file(path)}


def _quantization_summary(report: dict[str, Any], check: dict[str, Any]) -> dict[str, Any]:
    against = check["against"] or {}
    top1 = {name: against[name]["teacher_forced_top1_agreement"] if name in against else None
            for name in ("dequantized", "bf16")}
    return {
        "group_size": report["format"]["group_size"],
        "group_size_reason": report["format"]["group_size_reason"],
        "bits_per_weight": report["bits_per_weight"],
        "head": report["head"]["stored"],
        "search": report["algorithm"]["search"],
        "calibration": {k: report["calibration"][k] for k in ("corpus", "samples", "length", "chat_samples")},
        "perplexity": {"reference": report["fidelity"]["perplexity_reference"],
                       "quantized": report["fidelity"]["perplexity_quantized"]},
        "engine_check": {
            "passed": check["passed"], "engine": check["engine"], "activation_mode": check["activation_mode"],
            "kernel_op": check["kernel_op"], "ran_kernel": check["ran_kernel"], "not_run": check["not_run"],
            "top1_vs_dequantized": top1["dequantized"], "top1_vs_bf16": top1["bf16"],
            "note": check["w4a8_gate_lifted"],
        },
    }


def _build(selection: dict[str, Any], model_record: dict[str, Any], model_dir: Path, weights_dir: Path,
           export: dict[str, Any] | None, exports_dir: Path, base: Path):
    """(build state, artifacts, quantization summary or None) of one target; ``export``:
    its export record, where its path is an export that was built."""
    stage = selection["path"]["build_with"].split()[0]
    if stage == _BUILT_BY_MODEL_STAGE:
        artifacts = [
            {"path": _relative(model_dir / f["path"], base), "name": f"{model_dir.name}/{f['path']}",
             "size": f["size"], "sha256": f["sha256"]}
            for f in model_record["files"]
        ]
        return {"state": "built", "detail": "the model stage's checkpoint, unquantized"}, artifacts, None
    name = selection["path"]["name"]
    built = weights_dir / name
    if stage == "quantize" and (built / REPORT_NAME).is_file():
        report = records.read(built / REPORT_NAME, "quantization")
        if report["model"]["fingerprint"] != model_record["fingerprint"]:
            raise EdgepathError(f"{built}: quantized from another model (fingerprint differs); re-run quantize@{name}")
        check = records.read(built / CHECK_NAME, "engine_check")
        artifacts = [_artifact(f, base, weights_dir) for f in sorted(built.iterdir()) if f.is_file()]
        checked = (f"engine check not run on the build host: {check['not_run']}" if check["not_run"]
                   else f"engine check {'passed' if check['passed'] else 'FAILED'}")
        return ({"state": "built", "detail": f"quantize@{name}: {report['format']['quant_method']} checkpoint, "
                 f"{checked}"},
                artifacts, _quantization_summary(report, check))
    if export is not None:
        artifacts = _export_artifacts(exports_dir / name, export, base)
        return {"state": "built", "detail": _export_detail(export)}, artifacts, None
    where = {"quantize": "quantize.paths", "export": "export.paths"}.get(stage)
    why = (f"{stage}@{name} has no complete output here (not in {where} in params.yaml, not run yet, or "
           f"interrupted)" if where else f"the {stage} stage does not exist in this pipeline yet")
    return {"state": "pending", "detail": f"built by the {stage} stage; {why}"}, [], None


def export_record(selection: dict[str, Any], exports_dir: Path, model_record: dict[str, Any]) -> dict[str, Any] | None:
    """The export record of the target's path, or None (not an export path, or not built)."""
    path = selection["path"]
    return _read_export(path["name"], exports_dir, model_record) if path["build_with"].startswith("export") else None


def _read_export(name: str, exports_dir: Path, model_record: dict[str, Any]) -> dict[str, Any] | None:
    """export@``name``'s record, for this model; None where that stage has not run."""
    directory = exports_dir / name
    if not (directory / EXPORT_RECORD).is_file():
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


def _export_detail(record: dict[str, Any]) -> str:
    parity, pte = record["parity"], record["pte"]
    sqnr = "exact" if parity["logit_sqnr_db"] is None else f"{parity['logit_sqnr_db']:.1f} dB"
    against_fp32 = (f"top-1 {parity['top1_agreement']:.3f}, KL {parity['kl_nats']:.4f} nats, logit SQNR {sqnr} "
                    f"against fp32 on {parity['positions']} held-out positions")
    if "soc" in record["program"]:
        calibration = record["calibration"]
        made = (f"export@{record['path']}: {record['program']['precision']} for {record['program']['soc']}, calibrated "
                f"on {calibration['samples']} x {calibration['length']} tokens of {calibration['corpus']} "
                f"({calibration['chat_samples']} chat turns); {against_fp32}")
    else:
        made = f"export@{record['path']}: {record['program']['precision']}; {against_fp32}"
    return f"{made}; .pte {pte['state']}" + ("" if pte["state"] == "built" else f": {pte['detail']}")


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
                   f"{fallback} on its CPU: {_export_detail(other)}"),
        "artifacts": _export_artifacts(exports_dir / fallback, other, base)}}


def _verification(selection: dict[str, Any], verify_dir: Path, export: dict[str, Any] | None,
                  base: Path) -> dict[str, Any]:
    path = selection["path"]
    static = {"verified": path["verified"], "record": None}
    if export is not None:
        return {**static, **_export_verification(path["name"], export)}
    if not (path["runs_in_vllm"] and path["quantization"]):
        return {**static, "state": "not run here",
                "detail": f"patch-verify runs the 4-bit vLLM CPU paths; {path['name']} is built by "
                          f"{path['build_with'].split()[0]}"}
    record_path = verify_dir / f"{path['name']}.json"
    if not record_path.is_file():
        return {**static, "state": "not run here",
                "detail": f"patch-verify@{path['name']} has not run (add {path['name']} to quantize.paths)"}
    record = records.read(record_path, VERIFY_KIND)
    reference = {"record": _relative(record_path, base)}
    reason = covers_target(record, selection["profile"]["summary"])
    if reason is not None:
        return {**static, **reference, "state": "not run here", "detail": reason}
    host = record["host"]["summary"]
    where = f"on the build host ({host['cpu_model'] or host['arch']}, {host['kernel_isa']})"
    patches = {name: p["state"] for name, p in record["patches"].items()}
    if not record["passed"]:
        return {"verified": False, **reference, "state": "failed", "patches": patches,
                "detail": f"patch-verify {where}: {'; '.join(record['failures'])}"}
    agreement = record["check"]["against"]["dequantized"]["teacher_forced_top1_agreement"]
    return {"verified": True, **reference, "state": "passed", "patches": patches,
            "detail": (f"patch-verify {where}: every quantized layer ran {record['check']['kernel_op']}, top-1 "
                       f"agreement with the checkpoint's own weights {agreement:.3f}, warm start "
                       f"{record['starts']['warm_s']:.0f} s from the compile cache (cold "
                       f"{record['starts']['cold_s']:.0f} s)")}


def _export_verification(name: str, export: dict[str, Any]) -> dict[str, Any]:
    check = export.get("runtime_check")
    if check is None:
        return {"state": "not run here",
                "detail": (f"{name}'s program was checked against fp32 on the build host with its quantization "
                           f"simulated (export record); no NPU ran it")}
    eager, greedy = check["against_eager"], check["greedy"]
    return {"state": "checked off-device",
            "detail": (f"{name}'s .pte ran in {check['engine']} (the build host, not a phone): teacher-forced top-1 "
                       f"{eager['top1_agreement']:.3f} against {eager['what']} (against fp32: the .pte "
                       f"{export['parity']['top1_agreement']:.3f}, the eager model "
                       f"{check['eager_against_fp32']['top1_agreement']:.3f}), {greedy['reproduced']}/"
                       f"{greedy['prompts']} prompts reproduced over {greedy['tokens']} tokens; no phone ran it")}


def _benchmark(selection: dict[str, Any], record: dict[str, Any] | None, record_path: Path,
               imported: list[tuple[str, dict[str, Any]]], export: dict[str, Any] | None,
               base: Path) -> dict[str, Any]:
    """A target's headline figures from the benchmark (``benchmark.for_target``), with the
    run's date, host digest and versions, the measuring host's where imported; or why
    there are none (with a phone program's decode on the build host, where it ran)."""
    if record is None:
        return {"state": "not run", "detail": "the benchmark stage has not run", "record": None}
    reference = {"record": _relative(record_path, base)}
    state, arm, detail = for_target(selection, record, imported)
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
                        "perplexity": fid["perplexity"], "top1_vs_bf16": fid["top1_vs_bf16"],
                        "prompts_reproduced": fid["prompts_reproduced"], "prompts": fid["prompts"]},
            "ratios": arm["ratios"],
            "run": {**run, "record": run["record"] or reference["record"]}}


def target_metrics(manifest: dict[str, Any]) -> dict[str, Any]:
    """Each target's headline figures and ratios, for ``dvc metrics``."""
    metrics = {}
    for t in manifest["targets"]:
        b = t["benchmark"]
        if "figures" in b:
            metrics[t["tag"]] = {**{k: b["figures"][k] for k in ("decode_tok_s", "prefill_tok_s", "perplexity",
                                                                 "prompts_reproduced")},
                                 **{k: b["ratios"][k] for k in ("decode_vs_bf16", "decode_vs_llama_q4_k_m")}}
        elif "export" in t:  # a phone: its program against fp32, and its decode off-device
            parity, check = t["export"]["parity"], t["export"].get("runtime_check")
            metrics[t["tag"]] = {"top1_vs_fp32": parity["top1_agreement"], "kl_vs_fp32": parity["kl_nats"],
                                 "logit_sqnr_db": parity["logit_sqnr_db"],
                                 **({"off_device_decode_tok_s": check["decode_tok_s"]["median"]} if check else {})}
    return metrics


def build(params: Params, model_record_path: str | os.PathLike, selections_dir: str | os.PathLike,
          out: str | os.PathLike, weights_dir: str | os.PathLike = "build/weights",
          verify_dir: str | os.PathLike = "build/verify",
          exports_dir: str | os.PathLike = "build/exports",
          benchmark_path: str | os.PathLike = "build/benchmark/benchmark.json",
          benchmark_imports: list[str] = (), releases_path: str | os.PathLike = release.RELEASES) -> dict[str, Any]:
    """Gather the fleet into a manifest record and write it atomically to ``out``.
    ``benchmark_imports``: benchmark records measured on other hosts, for targets this
    host cannot measure; ``releases_path``: the versions released (``release``)."""
    model_record = records.read(model_record_path, "model")
    releases = release.read_releases(releases_path)
    benchmark_path = Path(benchmark_path)
    benchmark = records.read(benchmark_path, BENCHMARK_KIND) if benchmark_path.is_file() else None
    imported = [(str(f), records.read(f, BENCHMARK_KIND)) for f in benchmark_imports]
    for where, r in [(str(benchmark_path), benchmark), *imported]:
        if r is not None and r["model"]["fingerprint"] != model_record["fingerprint"]:
            raise EdgepathError(f"{where}: measured another model (fingerprint differs); re-run the benchmark")
    model_dir = model_directory(model_record_path, model_record)
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
            "profile": selection["profile"],
            "path": selection["path"],
            "build": build_state,
            "verification": _verification(selection, Path(verify_dir), export, base),
            "benchmark": _benchmark(selection, benchmark, benchmark_path, imported, export, base),
            "artifacts": artifacts,
            **({"quantization": quantization} if quantization else {}),
            **({"export": export} if export else {}),
        })
        targets[-1]["release"] = release.state(targets[-1], releases)
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


def _verified_cell(verification: dict[str, Any]) -> str:
    if verification["state"] == "failed":
        return "FAILED"
    return ("yes" if verification["verified"] else "NO") + (" (here)" if verification["state"] == "passed" else "")


def _benchmark_line(b: dict[str, Any]) -> str:
    if "figures" not in b:
        return f"{b['state']}: {b['detail']}"
    f, r = b["figures"], b["ratios"]

    def times(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    llama_ppl = r["llama_q4_k_m_perplexity_increase"]
    return (f"{b['state']} {b['run']['date'][:10]}: decode {f['decode_tok_s']:.1f} tok/s ({times(r['decode_vs_bf16'])} "
            f"vLLM bf16, {times(r['decode_vs_llama_q4_k_m'])} llama.cpp Q4_K_M), prefill {f['prefill_tok_s']:.0f} "
            f"tok/s, perplexity {f['perplexity']:.2f} ({r['perplexity_increase']:+.2f} over bf16"
            f"{'' if llama_ppl is None else f'; Q4_K_M {llama_ppl:+.2f}'}), {f['prompts_reproduced']}/{f['prompts']} "
            f"prompts reproduced{'' if r['llama_q4_k_m_prompts_reproduced'] is None else ' (Q4_K_M ' + str(r['llama_q4_k_m_prompts_reproduced']) + ')'}")


def version_cell(release: dict[str, Any]) -> str:
    return release["version"] or ("-" if release["state"] == "not built" else "unreleased")


def table(rows: list[tuple[str, ...]]) -> list[str]:
    """``rows`` (the first is the header) as lines of left-aligned columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def render(manifest: dict[str, Any]) -> str:
    """The manifest as a table, then each target's rationale and notes."""
    m = manifest["model"]
    lines = [
        f"model  {m['architecture']}, {m['parameters'] / 1e6:.1f}M parameters, "
        f"from {m['source'].get('package') or m['source'].get('path')}",
        f"       fingerprint {m['fingerprint'][:19]}  digest {m['digest'][:19]}",
        "",
    ]
    header = ("TAG", "PLATFORM", "DEVICE", "PATH", "QUANT", "GROUP", "BITS/W", "VLLM", "VERIFIED", "BUILD", "VERSION")
    rows = [header]
    for t in manifest["targets"]:
        s, p = t["profile"]["summary"], t["path"]
        device = s["arch"] + ("" if s["accelerator"] == "none" else f" + {s['gpu_name'] or s['accelerator']}")
        rows.append((
            t["tag"], t["platform"], f"{device}, {s['n_physical']}c/{_gib(s['ram_total_bytes'])}",
            p["name"], p["quantization"] or "-", str(p["group_size"] or "-"), f"{p['bits_per_weight']:.2f}",
            "yes" if p["runs_in_vllm"] else "no", _verified_cell(t["verification"]),
            f"{t['build']['state']} ({len(t['artifacts'])} files)" if t["artifacts"] else t["build"]["state"],
            version_cell(t["release"]),
        ))
    lines += table(rows)
    for t in manifest["targets"]:
        lines += ["", f"{t['tag']}: {t['path']['rationale']}"]
        lines += [f"  - {note}" for note in t["path"]["notes"]]
        lines.append(f"  - build: {t['build']['detail']}")
        fallback = t.get("export", {}).get("fallback")
        if fallback:
            lines.append(f"  - meanwhile: {fallback['state']}: {fallback['detail']}")
        lines.append(f"  - verification: {t['verification']['state']}: {t['verification']['detail']}")
        lines.append(f"  - benchmark: {_benchmark_line(t['benchmark'])}")
        lines.append(f"  - release: {t['release']['state']}: {t['release']['detail']}")
    return "\n".join(lines) + "\n"
