"""Smoke test run inside an edgepath image; prints one JSON object.

Fed on stdin by images/build (``podman run -i --entrypoint python3 IMAGE -
--expect-machine x86_64 --expect-engine vllm < images/smoke.py``), so nothing
test-only ships in the image. In the image it:

1. probes the machine with ``edgepath probe`` and selects the host's weight path
   with ``edgepath select`` (the installed console script, as a stage runs it);
2. where vLLM is installed, imports it and loads its CPU kernels, and reports which
   kernel library the process mapped (x86-64: _C_AVX2, _C_AVX512 or _C, chosen at
   start from the CPU), which is what makes one x86 image serve every ISA tier;
3. where ExecuTorch is installed, reports its runtime's registered backends (XNNPACK
   runs the phone-cpu build; QNN lowers only with Qualcomm's SDK);
4. fails unless it runs on the expected machine (aarch64 under emulation), as the
   image's non-root user, and has the expected engine (``--expect-engine vllm``).

Standard library only (the image's own edgepath, torch and vLLM do the work).
"""

import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile


def _edgepath(*args: str) -> str:
    return subprocess.run(["edgepath", *args], check=True, capture_output=True, text=True).stdout


def _vllm() -> dict:
    if importlib.util.find_spec("vllm") is None:
        return {"installed": False}
    import torch
    import vllm
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    with open("/proc/self/maps") as maps:
        kernels = sorted({os.path.basename(line.split()[-1]) for line in maps
                          if "/vllm/_C" in line and line.rstrip().endswith(".so")})
    return {"installed": True, "version": vllm.__version__, "torch": torch.__version__,
            "platform": type(current_platform).__name__, "kernel_libraries": kernels}


def _executorch() -> dict:
    if importlib.util.find_spec("executorch") is None:
        return {"installed": False}
    from executorch.extension.pybindings.portable_lib import _get_registered_backend_names

    return {"installed": True, "version": importlib.metadata.version("executorch"),
            "backends": sorted(_get_registered_backend_names())}


def main() -> None:
    def option(name: str) -> str | None:
        return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None

    machine, engine = option("--expect-machine"), option("--expect-engine")
    if machine and platform.machine() != machine:
        sys.exit(f"smoke: running on {platform.machine()}, expected {machine}")
    if os.getuid() == 0:
        sys.exit("smoke: the image runs as root; it must run as its non-root user")
    with tempfile.TemporaryDirectory() as tmp:
        profile_path = os.path.join(tmp, "host.json")
        _edgepath("probe", "--out", profile_path)
        with open(profile_path) as f:
            profile = json.load(f)
        from edgepath.rules.profile import HardwareProfile

        kernel_isa = HardwareProfile.from_dict(profile).kernel_isa()
        selection = json.loads(_edgepath("select", "--profile", profile_path))
    result = {
        "machine": platform.machine(),
        "uid": os.getuid(),
        "python": platform.python_version(),
        "probe": {**{k: profile[k] for k in ("arch", "cpu_model", "n_physical", "accelerator")},
                  "kernel_isa": kernel_isa},
        "select": {k: selection[k] for k in ("name", "quantization", "runs_in_vllm")},
        "vllm": _vllm(),
        "executorch": _executorch(),
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    if engine and not result[engine]["installed"]:
        sys.exit(f"smoke: {engine} is not installed in this image")


if __name__ == "__main__":
    main()
