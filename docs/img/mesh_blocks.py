"""Draws ``mesh_blocks.png``: which block of a tensor each rank of a 2x4 mesh holds, for three layouts,
and what the busiest rank lacks when the tensor moves between them (``cost.moves.placed_words``, the
count the cost tables use). Run from the repository root: ``python docs/img/mesh_blocks.py``."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from shardplan.cluster.mesh import rank_blocks  # noqa: E402
from shardplan.cost.moves import placed_words  # noqa: E402

MESH = (2, 4)
SHAPE = (8, 8)  # (batch rows, feature columns)
LAYOUTS = {  # title -> (split factors per tensor axis, tensor axis each mesh axis splits)
    "before: batch on axis 0 (2),\nfeatures on axis 1 (4)": ((2, 4), (0, 1)),
    "nested: batch on axes 0 and 1 (8)": ((8, 1), (0, 0)),
    "crossed: batch on axis 1 (4),\nfeatures on axis 0 (2)": ((4, 2), (1, 0)),
}


def owners(factors, placement) -> np.ndarray:
    """(rows, cols) grid of the rank holding each element (every element has one owner here)."""
    blocks = rank_blocks(np.array([placement]), MESH, 2)[0]  # (ranks, 2) block index per axis
    grid = np.zeros(SHAPE, dtype=int)
    rows, cols = SHAPE[0] // factors[0], SHAPE[1] // factors[1]
    for rank, (bi, bj) in enumerate(blocks):
        grid[bi * rows:(bi + 1) * rows, bj * cols:(bj + 1) * cols] = rank
    return grid


def main() -> None:
    names = list(LAYOUTS)
    layouts = {n: np.array([list(f) + list(p)]) for n, (f, p) in LAYOUTS.items()}
    fig, axes = plt.subplots(1, 3, figsize=(11, 4.2))
    cmap = plt.get_cmap("tab10")
    for ax, name in zip(axes, names):
        factors, placement = LAYOUTS[name]
        grid = owners(factors, placement)
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=9)
        for (i, j), r in np.ndenumerate(grid):
            ax.text(j, i, str(r), ha="center", va="center", fontsize=8, color="white")
        title = name
        if name != names[0]:
            lack = float(placed_words(SHAPE, MESH, layouts[names[0]], layouts[name])[0, 0])
            title += f"\nbusiest rank lacks {lack:.0f} of its {SHAPE[0] * SHAPE[1] // 8} elements"
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("features")
        ax.set_ylabel("batch")
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle("An 8 x 8 tensor on a 2 x 4 mesh: the number in a cell is the rank holding it", fontsize=10)
    fig.tight_layout()
    out = os.path.join(os.path.dirname(__file__), "mesh_blocks.png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
