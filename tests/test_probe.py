import errno
import os
import shutil

import pytest

from edgepath.core.errors import EdgepathError
from edgepath.rules.profile import HardwareProfile
from edgepath.stages import probe

from .conftest import HOSTS

EXPECTED = {
    "xeon-8480c-8vcpu": dict(
        arch="x86_64", cpu_vendor="GenuineIntel", n_physical=4, n_logical=8, accelerator="none",
        supports_bf16=True, torch_amx_tile_supported=True, ram_total_bytes=32 * 2**30,
        has={"amx_tile", "amx_bf16", "amx_int8", "avx512f", "avx512_bf16", "avx512_vnni", "avx2"},
        lacks={"neon"},
    ),
    "ryzen-5800x-desktop": dict(
        arch="x86_64", cpu_vendor="AuthenticAMD", n_physical=8, n_logical=16, accelerator="none",
        supports_bf16=False, torch_amx_tile_supported=False,
        has={"avx2"}, lacks={"avx512f", "amx_tile", "avx512_bf16"},
    ),
    "amd-epyc-zen4-2vcpu": dict(  # captured on this team's build machine
        arch="x86_64", cpu_vendor="AuthenticAMD", n_physical=2, n_logical=2, accelerator="none",
        supports_bf16=True, torch_amx_tile_supported=False,
        has={"avx512f", "avx512_bf16", "avx512_vnni"}, lacks={"amx_tile"},
    ),
    "graviton3-16vcpu": dict(
        arch="aarch64", cpu_vendor="ARM", cpu_model="Neoverse-V1", n_physical=16, n_logical=16,
        accelerator="none", supports_bf16=True, torch_amx_tile_supported=None,
        has={"neon", "dotprod", "i8mm", "bf16", "sve"}, lacks={"asimd", "asimddp", "sme"},
    ),
    "snapdragon-8gen3-phone": dict(
        arch="aarch64", n_physical=8, n_logical=8, accelerator="npu:qualcomm", npu_driver="fastrpc",
        ram_total_bytes=12 * 2**30, has={"neon", "i8mm", "bf16"}, lacks={"sve"},
    ),
    "epyc-l4-gpu": dict(
        arch="x86_64", accelerator="cuda_discrete", gpu_name="NVIDIA L4",
        gpu_mem_bytes=23034 * 2**20, gpu_compute_capability="8.9", supports_bf16=True,
        has={"avx2"}, lacks=set(),
    ),
}


@pytest.mark.parametrize("host", sorted(EXPECTED))
def test_probe_reads_snapshot(host):
    expected = dict(EXPECTED[host])
    has, lacks = expected.pop("has"), expected.pop("lacks")
    p = probe.probe(HOSTS / host)
    for field, value in expected.items():
        assert getattr(p, field) == value, field
    assert has <= set(p.cpu_flags)
    assert not lacks & set(p.cpu_flags)
    assert p.source == f"snapshot: {host}"


def test_phone_cpu_model_names_every_core_type():
    p = probe.probe(HOSTS / "snapdragon-8gen3-phone")
    assert "Cortex-X4" in p.cpu_model and "Cortex-A520" in p.cpu_model and "Pineapple" in p.cpu_model


def test_smt_siblings_count_once_as_physical_cores(tmp_path):
    # The Ryzen snapshot lists 16 CPUs over 8 (package, core) pairs.
    p = probe.probe(HOSTS / "ryzen-5800x-desktop")
    assert (p.n_physical, p.n_logical) == (8, 16)


def test_an_empty_root_is_refused_not_a_profile_of_defaults(tmp_path):
    with pytest.raises(EdgepathError, match="proc/cpuinfo: no such file"):
        probe.probe(tmp_path)


def snapshot(d, host="ryzen-5800x-desktop"):
    """A copy of a host's snapshot, to spoil one file of."""
    shutil.copytree(HOSTS / host, d / host)
    return d / host


@pytest.mark.parametrize("cpuinfo, message", [
    ("", "not a CPU description"),
    ("root:x:0:0:root:/root:/bin/bash\n", "not a CPU description"),
    ("processor\t: AArch64 Processor rev 4\n", "not a CPU description"),  # a header, not a CPU number
])
def test_a_cpuinfo_without_processor_entries_is_refused(tmp_path, cpuinfo, message):
    root = snapshot(tmp_path)
    (root / "proc/cpuinfo").write_text(cpuinfo)
    with pytest.raises(EdgepathError, match=message):
        probe.probe(root)


def test_an_architecture_nothing_tells_is_refused(tmp_path):
    root = snapshot(tmp_path)
    (root / ".edgepath/uname-m").unlink()
    (root / "proc/cpuinfo").write_text("processor\t: 0\nmodel name\t: something\n")
    with pytest.raises(EdgepathError, match="cannot tell the architecture"):
        probe.probe(root)


@pytest.mark.parametrize("rel, text, message", [
    (".edgepath/uname-m", "x86_64; rm -rf ~\n", "not a machine name"),
    ("sys/devices/system/cpu/online", "\n", "not a list of CPUs"),
    ("sys/devices/system/cpu/online", "3-0\n", "not a list of CPUs"),
    ("sys/devices/system/cpu/online", "all\n", "not a list of CPUs"),
    ("proc/meminfo", "MemFree: 1 kB\n", "no MemTotal"),
    ("proc/meminfo", "MemTotal: lots\nMemFree: 1 kB\n", "no MemTotal"),
    ("proc/meminfo", "MemTotal: 1024 kB\n", "MemAvailable"),
    (".edgepath/torch_amx_tile_supported", "maybe\n", "not true or false"),
])
def test_a_file_that_does_not_say_what_it_should_is_refused_by_name(tmp_path, rel, text, message):
    root = snapshot(tmp_path)
    (root / rel).write_text(text)
    with pytest.raises(EdgepathError, match=f"{rel}: .*{message}"):
        probe.probe(root)


def test_a_missing_meminfo_is_refused_not_zero_bytes(tmp_path):
    root = snapshot(tmp_path)
    (root / "proc/meminfo").unlink()
    with pytest.raises(EdgepathError, match="meminfo: no such file.*RAM"):
        probe.probe(root)


@pytest.mark.parametrize("rel", ["proc/cpuinfo", "proc/sys/kernel/osrelease", "sys/devices/system/cpu/online"])
def test_permission_denied_is_refused_not_taken_for_a_missing_file(tmp_path, monkeypatch, rel):
    # Simulated at os.open: chmod 000 does not stop root, who runs some of these tests.
    root = snapshot(tmp_path)
    denied, real_open = str(root / rel), os.open

    def open_denying(path, *args, **kwargs):
        if str(path) == denied:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_denying)
    with pytest.raises(EdgepathError, match=f"{rel}: permission denied"):
        probe.probe(root)


@pytest.mark.parametrize("text, gpu", [
    ("NVIDIA L4, 23034, 8.9\n", ("NVIDIA L4", 23034 * 2**20, "8.9")),
    ("NVIDIA L4, 23034, 8.9\nNVIDIA L4, 23034, 8.9\n", ("NVIDIA L4", 23034 * 2**20, "8.9")),  # the first GPU
    ("Orin (nvgpu), [N/A], 8.7\n", ("Orin (nvgpu)", None, "8.7")),
    ("Tesla K80, 11441, [Not Supported]\n", ("Tesla K80", 11441 * 2**20, None)),
    (None, None), ("", None), ("\n\n", None), (",,,\n", None), (",,\n", None),
    ("NVIDIA L4\n", None), ("NVIDIA L4, 23034\n", None), ("NVIDIA L4, 23034, 8.9, extra\n", None),
    (" , 23034, 8.9\n", None), ("NVIDIA L4, lots, 8.9\n", None), ("NVIDIA L4, -1, 8.9\n", None),
    ("NVIDIA L4, 23034, eight\n", None), ("No devices were found\n", None),
])
def test_an_nvidia_smi_line_that_is_not_a_gpu_is_no_gpu(text, gpu):
    assert probe.parse_nvidia_smi(text) == gpu


@pytest.mark.parametrize("capture", [",,,\n", "NVIDIA L4, 23034\n", " , 23034, 8.9\n", "NVIDIA L4, lots, 8.9\n", ""])
def test_a_malformed_gpu_capture_probes_as_no_gpu(tmp_path, capture):
    root = snapshot(tmp_path)
    (root / ".edgepath/nvidia-smi.csv").write_text(capture)
    p = probe.probe(root)
    assert (p.accelerator, p.gpu_name, p.gpu_mem_bytes, p.supports_bf16) == ("none", None, None, False)


def test_capture_snapshot_of_a_root_that_does_not_probe_writes_nothing(tmp_path):
    with pytest.raises(EdgepathError, match="no such file or directory"):
        probe.capture_snapshot(tmp_path / "a" / "snap", root=tmp_path / "nonexistent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EdgepathError, match="cpuinfo: no such file"):
        probe.capture_snapshot(tmp_path / "a" / "snap", root=tmp_path / "empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_capture_snapshot_replaces_an_earlier_snapshot_only(tmp_path):
    earlier = snapshot(tmp_path)  # a snapshot of the Ryzen, captured again from the Graviton
    probe.capture_snapshot(earlier, root=HOSTS / "graviton3-16vcpu")
    assert probe.probe(earlier).stable_dict() | {"source": ""} == (
        probe.probe(HOSTS / "graviton3-16vcpu").stable_dict() | {"source": ""})
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(EdgepathError, match="not a snapshot"):
        probe.capture_snapshot(mine, root=HOSTS / "graviton3-16vcpu")
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    with pytest.raises(EdgepathError, match="is or holds the root"):
        probe.capture_snapshot(tmp_path, root=earlier)


def test_live_host_probe_matches_its_own_snapshot(tmp_path):
    live = probe.probe("/")
    probe.capture_snapshot(tmp_path / "snap")
    again = probe.probe(tmp_path / "snap")
    assert live.stable_dict() | {"source": ""} == again.stable_dict() | {"source": ""}
    assert live.n_logical >= 1 and live.ram_total_bytes > 0


def test_live_host_records_torch_amx_check():
    import platform

    import torch

    live = probe.probe("/")
    if platform.machine() != "x86_64":
        pytest.skip("PyTorch's AMX check is x86-only; this host is " + platform.machine())
    assert live.torch_amx_tile_supported is bool(torch.cpu._is_amx_tile_supported())


def test_profile_json_of_a_probe_round_trips():
    p = probe.probe(HOSTS / "xeon-8480c-8vcpu")
    assert HardwareProfile.from_json(p.to_json()) == p
