"""Write the GPU check's JSON (`scripts/gpu_check.py device`) into docs/gpu.md's results section, between its
`<!-- gpu-check -->` markers: the device, its copy bandwidth, greedy agreement with the CPU engine, and per model
tinyloop's tokens/s beside `transformers`' and the bandwidth bound (bytes a decode step reads ÷ copy bandwidth).

    python scripts/gpu_report.py RESULT.json [--doc docs/gpu.md]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = [("decode_1", "decode, 1 stream"), ("decode_16", "decode, 16 streams"), ("prefill", "prefill"),
         ("speculative_1", "self-speculative, 1 stream")]  # fmt: skip


def tables(r: dict) -> str:
    bw = r["copy_bandwidth"]
    lines = [
        f"Device: {r.get('name', r['device'])} (torch {r['torch']}, CUDA {r['torch_cuda']}); measured copy "
        f"bandwidth {bw / 1e9:,.0f} GB/s.",
        "",
        "| model | mode | tinyloop tok/s | transformers (bf16) tok/s | ratio | % of bandwidth bound |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in r["models"].items():
        if "tinyloop" not in m:
            lines.append(f"| {name} | {m.get('skipped', 'not run')} | | | | |")
            continue
        bound = bw / m["bytes_per_token"]
        peer = r.get("transformers", {}).get(name.split()[0], {})  # the bf16 peer of that shape, for every type
        for key, label in MODES:
            ours = m["tinyloop"][key]
            theirs = peer.get(key)
            ratio = f"{ours / theirs:.2f}×" if theirs else ""
            share = f"{100 * ours / bound:.0f}%" if key == "decode_1" else ""
            peer_cell = f"{theirs:,.1f}" if theirs else ""
            if key == "prefill":
                label = f"prefill ({m['tinyloop']['prefill_tokens']} tokens)"
            lines.append(f"| {name} | {label} | {ours:,.1f} | {peer_cell} | {ratio} | {share} |")
    lines += ["", "| model | greedy tokens identical to the CPU engine (plain · batched · speculative) |", "|---|---|"]
    for name, m in r["models"].items():
        a = m.get("agreement")
        if a:
            cells = " · ".join(f"{a[k]['identical']}/{a[k]['of']}" for k in ("plain", "batched", "speculative"))
            lines.append(f"| {name} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result")
    p.add_argument("--doc", default=str(ROOT / "docs" / "gpu.md"))
    args = p.parse_args()
    doc = Path(args.doc)
    body = tables(json.loads(Path(args.result).read_text()))
    text, n = re.subn(
        r"<!-- gpu-check -->.*<!-- /gpu-check -->", f"<!-- gpu-check -->\n{body}\n<!-- /gpu-check -->",
        doc.read_text(), flags=re.S,
    )  # fmt: skip
    if n != 1:
        raise SystemExit(f"{doc}: no <!-- gpu-check --> section")
    doc.write_text(text)


if __name__ == "__main__":
    main()
