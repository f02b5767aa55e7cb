import dataclasses
import json

import pytest

from edgepath.core import records
from edgepath.core.errors import EdgepathError
from edgepath.rules.profile import HardwareProfile


def sample() -> HardwareProfile:
    return HardwareProfile(
        arch="x86_64", cpu_model="Intel(R) Xeon(R) Platinum 8480C",
        cpu_flags=["AMX_TILE", "avx2", "avx2"], n_physical=4, n_logical=8,
        ram_total_bytes=2**35, ram_available_bytes=2**34, supports_bf16=True, source="test",
    )


def test_every_field_has_a_default():
    p = HardwareProfile()
    assert p.accelerator == "none" and p.cpu_flags == [] and p.gpu_name is None


def test_flags_are_normalised_on_construction():
    assert sample().cpu_flags == ["amx_tile", "avx2"]


def test_round_trip_through_dict_and_json():
    p = sample()
    assert HardwareProfile.from_dict(p.to_dict()) == p
    assert HardwareProfile.from_json(p.to_json()) == p
    assert json.loads(p.to_json())["kind"] == "edgepath.profile"


def test_unknown_keys_from_a_newer_version_are_ignored():
    d = {**sample().to_dict(), "schema_version": 7, "l3_cache_bytes": 2**20, "pcie_gen": "5"}
    assert HardwareProfile.from_dict(d) == sample()
    records.validate("profile", d)  # a newer profile also passes the schema


@pytest.mark.parametrize("field, value", [
    ("n_physical", "8"), ("n_logical", True), ("ram_total_bytes", -1), ("supports_bf16", "yes"),
    ("cpu_flags", "avx2"), ("cpu_flags", ["avx2", 3]), ("gpu_name", 5), ("arch", None),
    ("accelerator", "tpu"), ("torch_amx_tile_supported", 1),
])
def test_wrong_types_are_refused_naming_the_field(field, value):
    d = {**sample().to_dict(), field: value}
    with pytest.raises(EdgepathError, match=field):
        HardwareProfile.from_dict(d)


def test_not_an_object_is_refused():
    with pytest.raises(EdgepathError, match="JSON object"):
        HardwareProfile.from_dict(["x86_64"])


@pytest.mark.parametrize("text, message", [
    ('["x86_64"]', "p.json: a JSON array where a JSON object is expected"),
    ("[" * 100_000, "p.json: JSON nested deeper than"),
    ('{"a": ' * 100 + "1" + "}" * 100, "p.json: JSON nested deeper than"),
    ("\x00\x01garbage", "p.json: not valid JSON"),
    ("", "p.json: not valid JSON"),
])
def test_from_json_refuses_what_is_not_a_profile_object_naming_where(text, message):
    with pytest.raises(EdgepathError, match=message):
        HardwareProfile.from_json(text, "p.json")


def test_digest_ignores_available_memory_only():
    a, b = sample(), dataclasses.replace(sample(), ram_available_bytes=1)
    assert a.digest() == b.digest()
    assert a.digest() != dataclasses.replace(sample(), n_physical=2).digest()


def test_schema_and_dataclass_agree_on_fields():
    props = set(records.schema("profile")["properties"]) - {"kind", "schema_version"}
    assert props == {f.name for f in dataclasses.fields(HardwareProfile)}
