"""What the report scripts share: a pytest-benchmark JSON read back with the line naming the machine it ran on,
and the head of a Markdown table."""

from __future__ import annotations

import json
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name, for the machine a figure was measured on."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def load(path: str) -> dict:
    """The JSON of a pytest-benchmark run, after printing the machine it ran on."""
    data = json.load(open(path))
    print(f"Machine: {data['machine_info'].get('cpu', {}).get('brand_raw', '?')}\n")
    return data


def header(*columns: str) -> None:
    """A Markdown table's header row and rule."""
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
