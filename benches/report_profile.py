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


def limit_cases(cases: list[dict]) -> list[dict]:
    """The cases the limit tables show: greedy and temperature 1 (the limits do not depend on the sampler)."""
    return [e for e in cases if e["sampling"] in ("greedy", "temperature 1")]


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
    for e in limit_cases(cases):
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
    levels(data, cases, bandwidth)


def served_from(bytes_: float, caches: dict[int, dict], threads: int) -> int:
    """The level a working set of `bytes_` split across `threads` cores is read from: 2, 3, or 4 for memory."""
    if 2 in caches and bytes_ / threads <= caches[2]["cache_bytes"]:
        return 2
    if 3 in caches and bytes_ <= 0.5 * caches[3]["cache_bytes"]:
        return 3
    return 4


def levels(data: dict, cases: list[dict], dram: float | None) -> None:
    """Per decode case: the block's matmuls and the head beside the bandwidth of the level their weights come from
    (every core reading; the block's weights split across the cores, each core the same share every loop)."""
    caches = {
        b["extra_info"]["level"]: b["extra_info"]
        for b in data["benchmarks"]
        if b["name"].startswith("test_cache_bandwidth") and b["extra_info"].get("threads", 1) > 1
    }
    if not caches:
        return
    threads = max(c["threads"] for c in caches.values())
    rate = {2: caches.get(2, {}).get("gb_per_s"), 3: caches.get(3, {}).get("gb_per_s"), 4: dram}
    name = {2: "L2", 3: "L3", 4: "memory"}

    def frac(gbs: float, level: int) -> str:
        return f"{gbs / rate[level]:.0%}" if rate[level] else "?"

    print(
        "\n"
        + ", ".join(
            f"{name[lv]} {c['gb_per_s']} GB/s ({threads} threads, {c['cache_bytes'] >> 20} MB)"
            for lv, c in caches.items()
        )
        + f", memory {dram} GB/s (bench_machine.py, same run)\n"
    )
    print(
        "| model | streams | loops | sampling | block MB per loop | read from | matmul GB/s | ÷ level | head MB "
        "| read from | head GB/s | ÷ level |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for e in limit_cases(cases):
        ms = e["ms_per_token"]
        block, head = e["block_bytes"] * e["streams"], e["head_bytes"] * e["streams"]
        lb, lh = served_from(block, caches, threads), served_from(head, caches, threads)
        mm = e["block_bytes"] * e["loops"] / ms["matmul"] / 1e6
        hd = e["head_bytes"] / ms["head"] / 1e6
        print(
            f"| {e['model']} | {e['streams']} | {e['loops']} | {e['sampling']} | {block / 1e6:.1f} | {name[lb]} | "
            f"{mm:.1f} | {frac(mm, lb)} | {head / 1e6:.1f} | {name[lh]} | {hd:.1f} | {frac(hd, lh)} |"
        )


if __name__ == "__main__":
    main(sys.argv[1])
