"""Tables of where a decode step's time goes, and how close each case runs to the machine's limits, from a
pytest-benchmark JSON of `benches/bench_machine.py` and `benches/bench_profile.py` run together."""

from __future__ import annotations

import json
import sys

STAGES = ["matmul", "attention", "other blocks", "head", "sample", "rest of step", "python"]


def split(ms: dict[str, float]) -> dict[str, float]:
    """The nested stage totals as disjoint parts of the wall time per token."""
    return {
        "matmul": ms["matmul"],
        "attention": ms["attention"],
        "other blocks": ms["blocks"] - ms["matmul"] - ms["attention"],
        "head": ms["head"],
        "sample": ms["sample"],
        "rest of step": ms["step"] - ms["blocks"] - ms["head"] - ms["sample"],  # embedding, bookkeeping
        "python": ms["wall"] - ms["step"],
    }


def main(path: str) -> None:
    data = json.load(open(path))
    limits = {b["name"]: b["extra_info"] for b in data["benchmarks"] if "gb_per_s" in b["extra_info"]}
    limits |= {b["name"]: b["extra_info"] for b in data["benchmarks"] if "gflops" in b["extra_info"]}
    bandwidth = limits.get("test_read_bandwidth", {}).get("gb_per_s")
    gflops = limits.get("test_f32_flops", {}).get("gflops")
    print(
        f"Machine: {data['machine_info'].get('cpu', {}).get('brand_raw', '?')}: read bandwidth {bandwidth} GB/s, "
        f"f32 {gflops} GFLOP/s (bench_machine.py, same run)\n"
    )
    cases = [b["extra_info"] for b in data["benchmarks"] if "ms_per_token" in b["extra_info"]]
    print(
        "| model | streams | loops | sampling | tok/s | " + " | ".join(f"{s} ms" for s in STAGES) + " | sample share |"
    )
    print("|---|---|---|---|---|" + "---|" * len(STAGES) + "---|")
    for e in cases:
        ms = e["ms_per_token"]
        parts = split(ms)
        cells = " | ".join(f"{parts[s]:.3f}" for s in STAGES)
        print(
            f"| {e['model']} | {e['streams']} | {e['loops']} | {e['sampling']} | {1e3 / ms['wall']:.0f} | {cells} | "
            f"{parts['sample'] / ms['wall']:.1%} |"
        )
    print(
        "\n| model | streams | loops | sampling | weight MB per token | achieved GB/s | ÷ bandwidth | matmul GB/s "
        "| GFLOP/s | ÷ f32 peak |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for e in cases:
        if e["sampling"] not in ("greedy", "temperature 1"):
            continue  # the limits do not depend on the sampler
        ms = e["ms_per_token"]
        gbs = e["bytes_per_token"] / ms["wall"] / 1e6
        matmul_gbs = e["block_bytes"] * e["loops"] / ms["matmul"] / 1e6
        achieved = 2 * e["multiply_adds"] / ms["wall"] / 1e6
        bw = f"{gbs / bandwidth:.0%}" if bandwidth else "?"
        peak = f"{achieved / gflops:.0%}" if gflops else "?"
        print(
            f"| {e['model']} | {e['streams']} | {e['loops']} | {e['sampling']} | {e['bytes_per_token'] / 1e6:.0f} | "
            f"{gbs:.1f} | "
            f"{bw} | {matmul_gbs:.1f} | {achieved:.1f} | {peak} |"
        )


if __name__ == "__main__":
    main(sys.argv[1])
