"""Draws ``conv_halo.png``: a convolution's rows split over 4 ranks, the rows each rank holds and the
halo rows it receives from its neighbours (``execute.spatial.needed_rows``, the ranges the runtime
exchanges), for a 3x3 kernel of stride 1 and a 5x5 kernel of stride 2. Run from the repository
root (needs torch):
``python docs/img/conv_halo.py``."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from shardplan.execute.spatial import needed_rows  # noqa: E402

RANKS = 4
ROWS = 16
COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52")
CASES = {  # title -> (kernel, stride, padding, dilation)
    "3x3 kernel, stride 1, padding 1": (3, 1, 1, 1),
    "5x5 kernel, stride 2, padding 2": (5, 2, 2, 1),
}


def draw(ax, title: str, geometry: tuple) -> None:
    kernel, stride, pad, dil = geometry
    out_rows = (ROWS + 2 * pad - dil * (kernel - 1) - 1) // stride + 1
    block = ROWS // RANKS
    for r in range(RANKS):
        x = r * 1.6
        first, stop = needed_rows(r, RANKS, out_rows, geometry)
        for row in range(first, stop):
            own = r * block <= row < (r + 1) * block
            if 0 <= row < ROWS:
                owner = row // block
                ax.add_patch(Rectangle((x, -row - 1), 1.2, 0.9, color=COLORS[owner], alpha=1.0 if own else 0.45))
                if not own:
                    ax.text(x + 0.6, -row - 0.55, f"from {owner}", ha="center", va="center", fontsize=6)
            else:  # padding: zeros added on the edge rank
                ax.add_patch(Rectangle((x, -row - 1), 1.2, 0.9, fill=False, hatch="///", edgecolor="grey"))
        ax.text(x + 0.6, 3.0, f"rank {r}\n{out_rows // RANKS} output rows", ha="center", fontsize=7)
    ax.set_xlim(-0.3, RANKS * 1.6)
    ax.set_ylim(-ROWS - 3.5, 5)
    ax.set_title(title, fontsize=9)
    ax.axis("off")


def main() -> None:
    fig, axes = plt.subplots(1, len(CASES), figsize=(9, 5.2))
    for ax, (title, geometry) in zip(axes, CASES.items()):
        draw(ax, title, geometry)
    fig.suptitle("Input rows each rank reads for a row-split convolution (16 rows over 4 ranks):\n"
                 "solid = its own block, pale = halo received in one all-to-all, hatched = zero padding",
                 fontsize=9)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conv_halo.png")
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
