"""The calibration pass's Hessian products: ``gptq.HessianAccumulator`` (upper triangle in
row blocks, an fp32 sum folded into fp64) against the full product of every batch added
to an fp64 sum, interleaved, at Qwen2.5-1.5B's input widths (1536: attention and the
MLP's input; 8960: the down projection's), one thread, as each calibrate worker runs.

Also each one's largest error against an fp64 reference, relative to
``sqrt(H_ii H_jj)``, on activations with a few 300x outlier channels (real residual
streams have them), over more rows than one fold.

    .venv/bin/python -m benchmarks.hessian_products
"""

from __future__ import annotations

import argparse
import time

import torch

from edgepath.quant.gptq import HessianAccumulator

from .common import RESULTS, host, spread, today, write_json

WIDTHS = (1536, 8960)  # Qwen2.5-Coder-1.5B's linear inputs: hidden size and MLP width
ROWS = 2048  # one batch: 8 calibration windows of 256 tokens


def full_product(k: int):
    """The former accumulation: every batch's whole ``x^T x`` in fp32, summed in fp64."""
    total = torch.zeros(k, k, dtype=torch.float64)

    def add(x: torch.Tensor) -> None:
        total.add_((x.t() @ x).to(torch.float64))

    return add, total


def activations(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[:, :4] *= 300  # outlier channels
    return x


def relative_error(h: torch.Tensor, reference: torch.Tensor) -> float:
    d = reference.diagonal().sqrt()
    return float(((h - reference).abs() / (d[:, None] * d[None, :])).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for k in WIDTHS:
        x = activations(ROWS, k, seed=k)
        times = {"full": [], "accumulator": []}
        for _ in range(args.repeats):  # interleaved: a drift in the host's speed hits both
            add, _total = full_product(k)
            started = time.perf_counter()
            add(x)
            times["full"].append(time.perf_counter() - started)
            acc = HessianAccumulator(k)
            started = time.perf_counter()
            acc.add(x)
            times["accumulator"].append(time.perf_counter() - started)
        batches = [activations(ROWS, k, seed=k + i) for i in range(HessianAccumulator.FOLD_ROWS // ROWS + 2)]
        flat = torch.cat(batches).to(torch.float64)
        reference = 2 / flat.shape[0] * flat.t() @ flat
        add, total = full_product(k)
        acc = HessianAccumulator(k)
        for batch in batches:
            add(batch)
            acc.add(batch)
        full_s, acc_s = spread(times["full"], 4), spread(times["accumulator"], 4)
        rows.append({
            "in_features": k, "rows_per_batch": ROWS, "full_s": full_s, "accumulator_s": acc_s,
            "speedup": round(full_s["median"] / acc_s["median"], 2), "error_rows": flat.shape[0],
            "full_relative_error": relative_error(total * (2 / flat.shape[0]), reference),
            "accumulator_relative_error": relative_error(acc.h, reference),
        })
        print(f"K={k}: full {full_s['median']:.3f} s, accumulator {acc_s['median']:.3f} s per {ROWS}-row batch "
              f"({rows[-1]['speedup']}x); largest error {rows[-1]['full_relative_error']:.1e} / "
              f"{rows[-1]['accumulator_relative_error']:.1e} of sqrt(H_ii H_jj)", flush=True)
    write_json(RESULTS / "hessian_products.json", {
        "date": today(), "host": host(), "command": "python -m benchmarks.hessian_products", "threads": 1,
        "block": HessianAccumulator.BLOCK, "fold_rows": HessianAccumulator.FOLD_ROWS, "results": rows})


if __name__ == "__main__":
    main()
