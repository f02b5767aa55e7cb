"""llama.cpp for real (llama-cpp-python built by scripts/setup.sh) on a tiny Llama:
the control stage's conversion and quantization (the imatrix one by llama.cpp's own
tools, built by set-up from the same sources), the engine's scoring against
PyTorch on the same weights, and the benchmark's worker process around it."""

import pytest
import torch

from edgepath.core import records
from edgepath.core.errors import EdgepathError
from edgepath.engines.llama_cpp import LlamaCpp
from edgepath.engines.worker import Arm
from edgepath.rules.fleet import Calibration
from edgepath.stages import benchmark, control


@pytest.fixture(scope="module")
def tiny(default_model, tmp_path_factory):
    """A 1-layer Llama with the default model's real tokenizer (random weights, bf16),
    its model record, and the control stage's GGUFs of it: (hf dir, record, control dir)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from edgepath.stages import model

    work = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(default_model / "hf")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(work / "hf")
    tokenizer.save_pretrained(work / "hf")
    model.run(work / "model", source=str(work / "hf"))
    control.run(work / "model" / "model.json", work / "control", ["Q4_0", "Q4_0-imatrix", "F16"], threads=2,
                calibration=Calibration(samples=4, length=64))
    return work / "hf", work / "model" / "model.json", work / "control"


def test_control_stage_records_every_file_as_llama_cpp_loaded_it(tiny):
    _, model_record, out = tiny
    record = records.read(out / control.RECORD_NAME, control.RECORD_KIND)
    files = {f["type"]: f for f in record["files"]}
    assert set(files) == {"Q4_0", "Q4_0-imatrix", "F16"}
    # the importance matrix and its text are gone
    assert {p.name for p in out.iterdir()} == {"control.json", "model-q4_0.gguf", "model-q4_0-imatrix.gguf",
                                               "model-f16.gguf"}
    assert files["F16"]["bits_per_weight"] == pytest.approx(16, abs=0.01)
    # 4.5 bits on the layers; llama.cpp keeps the (tied) output table wider, and here it is most of the model
    assert 4.5 < files["Q4_0"]["bits_per_weight"] < 8
    assert files["Q4_0"]["size"] < files["F16"]["size"] / 2
    assert files["F16"]["parameters"] == records.read(model_record, "model")["parameters"]
    assert "AVX" in record["llama_cpp"]["system_info"] or "NEON" in record["llama_cpp"]["system_info"]


def test_the_imatrix_control_is_q4_0_weighted_by_llama_imatrix_over_the_calibration_windows(tiny):
    _, _, out = tiny
    files = {f["type"]: f for f in records.read(out / control.RECORD_NAME, control.RECORD_KIND)["files"]}
    weighted, plain = files["Q4_0-imatrix"], files["Q4_0"]
    # the same types on one layer (llama.cpp moves the first eighth of the layers' ffn_down to Q4_1
    # with an imatrix); the file's metadata names the matrix, so sizes differ by that
    assert weighted["bits_per_weight"] == plain["bits_per_weight"]
    assert weighted["sha256"] != plain["sha256"], "the importance matrix changed no rounding"
    assert "imatrix" not in plain
    made_from = weighted["imatrix"]
    assert (made_from["tool"], made_from["context"]) == ("llama-imatrix", 64)
    assert (made_from["calibration"]["samples"], made_from["calibration"]["length"]) == (4, 64)


def test_unknown_control_type_is_refused_and_writes_nothing(tiny, tmp_path):
    _, model_record, _ = tiny
    with pytest.raises(EdgepathError, match="unknown llama.cpp type"):
        control.run(model_record, tmp_path / "control", ["Q3_XXL"], threads=2)
    assert not (tmp_path / "control").exists()


def test_llama_cpp_scores_the_weights_pytorch_scores(tiny):
    """Perplexity and top-1 read from llama.cpp's per-position logits match PyTorch's
    on the same (F16-rounded) weights: the positions line up, nothing is off by one."""
    from transformers import AutoModelForCausalLM

    hf, _, out = tiny
    gen = torch.Generator().manual_seed(1)
    sequences = torch.randint(0, 49152, (2, 40), generator=gen).tolist()
    reference = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    engine = LlamaCpp(out / "model-f16.gguf", threads=2)
    try:
        scored = engine.score(sequences)
    finally:
        engine.close()
    for seq, nll, top1 in zip(sequences, scored["nll"], scored["top1"]):
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([seq])).logits[0, :-1]
        want_nll = torch.nn.functional.cross_entropy(logits, torch.tensor(seq[1:]), reduction="none")
        assert len(nll) == len(top1) == len(seq) - 1
        assert torch.allclose(torch.tensor(nll), want_nll, atol=0.05)
        agree = (torch.tensor(top1) == logits.argmax(-1)).float().mean().item()
        assert agree >= 0.9


def test_a_truncated_gguf_is_refused_clearly(tiny, tmp_path):
    _, _, out = tiny
    data = (out / "model-q4_0.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(EdgepathError, match="could not load"):
        LlamaCpp(tmp_path / "cut.gguf", threads=2)


def test_benchmark_worker_answers_over_its_pipe(tiny, tmp_path):
    _, _, out = tiny
    arm = Arm("llama.cpp Q4_0", "control", "llama.cpp", out / "model-q4_0.gguf")
    peaks = benchmark.PeakRss()
    peaks.start()
    worker = benchmark.Worker(arm, tmp_path / "cache", 2, tmp_path / "log", peaks)
    try:
        assert worker.start_s > 0 and worker.rss_anon_after_start > 0
        assert worker.info["bits_per_weight"] > 4
        prompt = list(range(100, 140))
        reply, other_share = worker.timed("decode", prompt=prompt, new_tokens=8)
        assert reply["seconds_per_token"] > 0 and 0 <= other_share <= 1
        assert worker.ask("prefill", prompt=prompt)["seconds"] > 0
        tokens = worker.ask("greedy", prompts=[prompt, prompt[:10]], new_tokens=5)["tokens"]
        assert [len(t) for t in tokens] == [5, 5]
        scored = worker.ask("score", sequences=[prompt])
        # greedy continues with the argmax the scored prefix ends on
        assert scored["top1"][0][-1] == worker.ask("greedy", prompts=[prompt[:-1]], new_tokens=1)["tokens"][0][0]
        with pytest.raises(EdgepathError, match="unknown op"):
            worker.ask("train")
    finally:
        worker.close()
        peaks.stop()
    assert peaks.peaks[worker.proc.pid] >= 0.9 * worker.rss_anon_after_start  # sampled while it ran


def test_benchmark_worker_that_cannot_start_says_why(tmp_path):
    arm = Arm("llama.cpp Q4_0", "control", "llama.cpp", tmp_path / "missing.gguf")
    peaks = benchmark.PeakRss()
    with pytest.raises(EdgepathError, match=r"engine process exited[\s\S]*could not load"):
        benchmark.Worker(arm, tmp_path / "cache", 2, tmp_path / "log", peaks)


def test_benchmark_refuses_a_control_made_from_another_model(tiny, default_model, tmp_path):
    _, _, control_dir = tiny
    with pytest.raises(EdgepathError, match="made from another model"):
        benchmark.run([], default_model / "model.json", tmp_path / "weights", tmp_path / "verify", control_dir,
                      tmp_path / "out", None, benchmark.Settings())
    assert not (tmp_path / "out").exists()
