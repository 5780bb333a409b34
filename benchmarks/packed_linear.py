"""Packed CPU linear layers (``engine/packed_linear.py``) against ``F.linear``, per weight size and
input rows: the table behind ``packed_rows`` (its row bounds and weight sizes).

Each case multiplies ``rows`` rows by 8 float32 weights in turn (distinct weights, so they come
from memory as a decode step's do, not from cache) four ways, interleaved: the product through
``F.linear`` (MKL's sgemm) and through oneDNN's packed weight (``f_linear_vs_packed``: above 1,
packing is faster), and an ``nn.Linear`` layer plain and routed through ``PackedLinear``
(``plain_vs_routed_layer``: what the rule gives, the wrapper's own cost included). Times are the
best of ``REPEAT`` alternating turns; ``rule_packs`` says whether the rule takes the packed path
there. Torch's threads as the sampler runs them (``OMP_NUM_THREADS`` or all cores).

Run: ``python -m benchmarks.packed_linear`` (writes ``benchmarks/results/packed_linear.json``).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from arctic_platform.engine import packed_linear
from benchmarks._common import write_result

# (out_features, in_features): from below the size rule to a Qwen3-0.6B MLP weight
SHAPES = [
    (128, 384),
    (256, 256),
    (256, 512),
    (512, 512),
    (1536, 512),
    (1024, 1024),
    (2048, 1024),
    (3072, 1024),
]
ROW_COUNTS = [1, 3, 4, 8, 16, 32, 64, 256, 1024]
WEIGHTS = 8
CALLS = 40
REPEAT = 5


def _per_call(call) -> float:
    """Seconds per call, cycling through the weights."""
    start = time.perf_counter()
    for n in range(CALLS):
        call(n % WEIGHTS)
    return (time.perf_counter() - start) / CALLS


def case(out_features: int, in_features: int, rows: int) -> dict:
    """The product through ``F.linear`` and packed, and an ``nn.Linear`` layer plain and routed
    (the rule's choice plus the wrapper's own cost), on the same inputs, interleaved."""
    weights = [torch.randn(out_features, in_features) for _ in range(WEIGHTS)]
    packs = [torch.ops.mkldnn._reorder_linear_weight(w, packed_linear.FIRST_ROW) for w in weights]
    plain, routed = [], []
    for w in weights:
        for layers in (plain, routed):
            layers.append(nn.Linear(in_features, out_features, bias=False).requires_grad_(False))
            layers[-1].weight.copy_(w)
        routed[-1].forward = packed_linear.PackedLinear(routed[-1])
    x = torch.randn(rows, in_features)
    ways = {
        "f_linear": lambda i: F.linear(x, weights[i]),
        "packed": lambda i: torch.ops.mkldnn._linear_pointwise(x, packs[i], None, "none", [], ""),
        "plain_layer": lambda i: plain[i](x),
        "routed_layer": lambda i: routed[i](x),
    }
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    with torch.inference_mode():
        for i in range(WEIGHTS):  # every layer packs its weight before the timing
            routed[i](x)
        for _ in range(REPEAT):
            for way, call in ways.items():
                seconds[way].append(_per_call(call))
    best = {way: min(times) for way, times in seconds.items()}
    return {
        "weight": [out_features, in_features],
        "rows": rows,
        **{f"{way}_us": s * 1e6 for way, s in best.items()},
        "f_linear_vs_packed": best["f_linear"] / best["packed"],
        "plain_vs_routed_layer": best["plain_layer"] / best["routed_layer"],
        "rule_packs": rows in packed_linear.packed_rows(out_features * in_features),
    }


def main() -> None:
    if not packed_linear.available():
        raise SystemExit("this torch build has no oneDNN packed linear")
    with torch.no_grad():
        cases = [case(o, i, rows) for o, i in SHAPES for rows in ROW_COUNTS]
    for c in cases:
        print(
            f"{c['weight'][0]:>5} x {c['weight'][1]:<5} rows {c['rows']:>5}: "
            f"product {c['f_linear_vs_packed']:.2f}x, layer {c['plain_vs_routed_layer']:.2f}x"
            f"{'  (rule: packed)' if c['rule_packs'] else ''}"
        )
    write_result(
        "packed_linear",
        {
            "torch_threads": torch.get_num_threads(),
            "rule": {
                "min_elements": packed_linear.MIN_ELEMENTS,
                "large_elements": packed_linear.LARGE_ELEMENTS,
                "rows": [packed_linear.FIRST_ROW, packed_linear.LAST_ROW],
                "rows_large": [packed_linear.FIRST_ROW_LARGE, packed_linear.LAST_ROW],
            },
            "cases": cases,
        },
    )


if __name__ == "__main__":
    main()
