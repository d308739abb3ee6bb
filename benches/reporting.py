"""What the report scripts share: a pytest-benchmark JSON read back with the line naming the machine it ran on,
and the head of a Markdown table."""

from __future__ import annotations

import json


def load(path: str) -> dict:
    """The JSON of a pytest-benchmark run, after printing the machine it ran on."""
    data = json.load(open(path))
    print(f"Machine: {data['machine_info'].get('cpu', {}).get('brand_raw', '?')}\n")
    return data


def header(*columns: str) -> None:
    """A Markdown table's header row and rule."""
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
