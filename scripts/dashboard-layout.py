#!/usr/bin/env python3
"""Draw the panel grid of the mpsd Grafana dashboard (titles, kinds, metrics) into a PNG.

    python scripts/dashboard-layout.py [DASHBOARD_JSON] [OUT_PNG]

Defaults: deploy/components/grafana-dashboard/mpsd-dashboard.json -> docs/dashboard-layout.png.
Needs matplotlib (not a dependency of mpsd: `pip install matplotlib` in any venv).
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

REPO = Path(__file__).resolve().parent.parent
COLORS = {"row": "#d9d9d9", "stat": "#dbeafe", "timeseries": "#dcfce7", "table": "#fef9c3",
          "state-timeline": "#fce7f3", "bargauge": "#ede9fe"}  # fmt: skip
METRIC = re.compile(r"\bmpsd_[a-z_]+")


def main(argv: list[str]) -> int:
    src = Path(argv[1]) if len(argv) > 1 else REPO / "deploy/components/grafana-dashboard/mpsd-dashboard.json"
    out = Path(argv[2]) if len(argv) > 2 else REPO / "docs/dashboard-layout.png"
    dash = json.loads(src.read_text())
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dash["panels"])
    fig, ax = plt.subplots(figsize=(16, bottom * 0.32))
    ax.set_xlim(0, 24)
    ax.set_ylim(bottom, 0)
    ax.axis("off")
    for p in dash["panels"]:
        g = p["gridPos"]
        ax.add_patch(Rectangle((g["x"] + 0.1, g["y"] + 0.1), g["w"] - 0.2, g["h"] - 0.2,
                               facecolor=COLORS.get(p["type"], "white"), edgecolor="#555555"))  # fmt: skip
        if p["type"] == "row":
            ax.text(g["x"] + 0.3, g["y"] + 0.55, p["title"], va="center", fontsize=11, weight="bold")
            continue
        ax.text(g["x"] + 0.3, g["y"] + 0.6, f"{p['title']}  [{p['type']}]", va="top", fontsize=9.5, weight="bold")
        metrics = sorted({m for t in p["targets"] for m in METRIC.findall(t["expr"])})
        width = max(int(g["w"] * 4.6), 20)
        body = "\n".join(metrics)
        if g["h"] > 4:
            body += "\n\n" + textwrap.fill(p.get("description", ""), width=width)
        ax.text(g["x"] + 0.3, g["y"] + 1.6, body, va="top", fontsize=8.5, family="monospace", color="#333333")
    ax.set_title(f"{dash['title']}: panel layout (from {src.name})", fontsize=13)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
