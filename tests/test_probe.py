import pytest

from edgepath import probe
from edgepath.profile import HardwareProfile

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


def test_empty_root_gives_defaults_not_a_crash(tmp_path):
    p = probe.probe(tmp_path)
    assert p.arch == "unknown" and p.n_logical == 0 and p.accelerator == "none"


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
