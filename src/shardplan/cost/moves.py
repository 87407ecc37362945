"""What one device receives and copies when a tensor moves between two layouts on an edge.

Element counts over every pair of layouts (``(L_src, L_dst)`` arrays), which
``cost.analytic.AnalyticCostModel.edge_prices`` turns into seconds: ``placed_words`` (what the
busiest device lacks of its new block, exact for DTensor's block order on a mesh),
``gathered_words`` (a runtime without an all-to-all gathers what a change of split dim leaves) and
``inner_copy_words`` (local concatenations and cuts along inner dims). docs/cost_model.md,
*Redistribution on edges*, gives the formulas.
"""

from __future__ import annotations

import numpy as np


def gathered_words(shape: tuple[int, ...], src_layouts: np.ndarray, dst_layouts: np.ndarray) -> np.ndarray:
    """Elements a device receives, (L_src, L_dst), when a move that changes the split dim (a dim split
    in the source and whole in the destination, and another split finer: an all-to-all) is done as a
    gather of the dims the source splits and the destination does not, then a local cut:
    the gathered tile less the source tile it held; 0 for every other pair of layouts."""
    t = np.array(shape, dtype=np.float64)
    src, dst = src_layouts[:, None, :], dst_layouts[None, :, :]
    left = (src > 1) & (dst == 1)  # split dims the move leaves
    new = dst > src  # dims the destination splits finer
    gathered = np.prod(t) / np.prod(np.where(left, 1, src), axis=2)
    held = np.prod(t) / np.prod(src, axis=2)
    return np.where(left.any(axis=2) & new.any(axis=2), gathered - held, 0.0)


def placed_words(shape: tuple[int, ...], mesh: tuple[int, ...], src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Elements the busiest consumer device lacks, (L_src, L_dst), when the tensor moves between
    placed layouts (``cluster.mesh.placed_layouts``: split factors, then the tensor axis of each mesh
    axis) on ``mesh``: exact for the blocks DTensor gives each rank.

    Along one tensor axis, the blocks of a rank under the two layouts are numbered by the mesh axes
    splitting it, first mesh axis outermost. Where the shorter list of axes is the head of the longer
    one, every rank's two blocks nest and it holds ``len / max(f_src, f_dst)`` of what it needs;
    otherwise some rank's two blocks are disjoint (pick its coordinates on the first differing pair
    of axes apart), and that rank lacks its whole tile. The busiest rank lacks the whole tile when
    any axis has such a pair, else ``prod(len / f_dst) - prod(len / max(f_src, f_dst))``.
    ``tests/test_cost_tiles.py`` checks this against every rank's blocks."""
    n, m = len(shape), len(mesh)
    t = np.array(shape, dtype=np.float64)
    fs, fd = src[:, :n].astype(np.float64), dst[:, :n].astype(np.float64)

    def order(placed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(L, n, m) mesh axes splitting each tensor axis in mesh order (padded -1), and their count."""
        pl = placed[:, n:]
        seq = np.full((len(placed), n, m), -1, dtype=np.int64)
        count = np.zeros((len(placed), n), dtype=np.int64)
        for a in range(m):
            for ax in range(n):
                on = pl[:, a] == ax
                seq[on, ax, count[on, ax]] = a
                count[on, ax] += 1
        return seq, count

    s_seq, s_k = order(src)
    d_seq, d_k = order(dst)
    k = np.minimum(s_k[:, None, :], d_k[None, :, :])  # (Ls, Ld, n)
    apart = np.zeros(k.shape, dtype=bool)
    for i in range(m):
        apart |= (i < k) & (s_seq[:, None, :, i] != d_seq[None, :, :, i])
    needed = np.prod(t / fd, axis=1)[None, :]
    held = np.prod(t / np.maximum(fs[:, None, :], fd[None, :, :]), axis=2)
    return np.where(apart.any(axis=2), needed, needed - held)


def inner_copy_words(shape: tuple[int, ...], src_layouts: np.ndarray, dst_layouts: np.ndarray) -> np.ndarray:
    """Elements a device copies locally in a move, (L_src, L_dst), besides what the network carries:
    a gather along an inner dim (some dim before it is more than 1 long on the device) arrives as
    the peers' tiles stacked along the outermost dim and is concatenated into place (a copy of the
    gathered tile); a cut along an inner dim is not a view of memory and is copied out (a copy of
    the destination tile). A gather or cut of the outermost non-trivial dim is free (a view).
    The gathered tile keeps the splits both layouts share, ``min(src, dst)`` per dim."""
    t = np.array(shape, dtype=np.float64)
    src, dst = src_layouts[:, None, :], dst_layouts[None, :, :]
    kept = np.minimum(src, dst)
    local = t / kept  # the tile between the gather and the cut
    before = np.cumsum(local > 1, axis=2) - (local > 1)  # dims longer than 1 before each dim
    inner = before > 0
    gathered = np.where(((src > dst) & inner).any(axis=2), np.prod(local, axis=2), 0.0)
    cut = np.where(((dst > src) & inner).any(axis=2), np.prod(t / dst, axis=2), 0.0)
    return gathered + cut
