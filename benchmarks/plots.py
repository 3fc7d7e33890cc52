"""PNG bar charts from the suite's JSON: one per scenario group, each method's ratio to the case's baseline.

python -m benchmarks.plots RESULTS.json DIR
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "group"


def group_rows(doc: dict) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for row in doc["rows"]:
        groups.setdefault(row["group"], []).append(row)
    return groups


def plot_group(group: str, rows: list[dict], path: Path) -> Path:
    """Grouped bars: x = case, one bar per method (name, path), height = ratio to the case's baseline (log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in rows))
    methods = list(dict.fromkeys((r["name"], r["path"]) for r in rows))
    baselines = sorted({r["baseline"] for r in rows if r["baseline"]})
    width = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(
        figsize=(min(16.0, max(6.0, 0.3 * len(cases) * len(methods) + 2)), 4.0), dpi=80
    )
    for i, (name, method_path) in enumerate(methods):
        xs, ys, rates = [], [], []
        for j, case in enumerate(cases):
            match = [
                r
                for r in rows
                if r["case"] == case and r["name"] == name and r["path"] == method_path
            ]
            if match and match[0]["ratio"]:
                xs.append(j - 0.4 + width * (i + 0.5))
                ys.append(match[0]["ratio"])
                rates.append(match[0]["gb_per_s"])
        bars = ax.bar(xs, ys, width, label=f"{name} [{method_path}]" if method_path else name)
        if any(rate is not None for rate in rates):
            ax.bar_label(bars, ["" if r is None else f"{r:.2f}" for r in rates], fontsize=6)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks(
        range(len(cases)),
        cases,
        rotation=30 if len(cases) > 4 else 0,
        ha="right" if len(cases) > 4 else "center",
        fontsize=8,
    )
    ax.set_ylabel(f"x baseline ({', '.join(baselines)})\n= baseline s / s, log scale", fontsize=8)
    gbs = " (labels: GB/s)" if any(r["gb_per_s"] is not None for r in rows) else ""
    ax.set_title(f"{group}: speed relative to baseline (> 1 is faster){gbs}", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_plots(doc: dict, directory: Path) -> list[Path]:
    """One PNG per group into `directory` (created); returns the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    return [
        plot_group(group, rows, directory / f"{slug(group)}.png")
        for group, rows in group_rows(doc).items()
    ]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    for path in write_plots(json.loads(Path(argv[0]).read_text()), Path(argv[1])):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
