"""OptCNN's graph reduction (a rival to ``exact``), for series-parallel graphs.

Jia, Lin, Qi and Aiken, "Exploring Hidden Dimensions in Parallelizing Convolutional Neural
Networks", ICML 2018, section 5. The objective is the tables' (``cost.tables``)

    F(c) = sum_v n_v(c_v) + sum_(u,v) E_uv(c_u, c_v)

and two rewrites keep its minimum (and, by remembering the argmins, its minimiser):

* **Node elimination** (OptCNN Theorem 1): an op ``v`` whose only edges join it to ``u`` and ``w``
  is folded into a new edge table ``E'_uw(a, c) = min_b [E_uv(a, b) + n_v(b) + E_vw(b, c)]``, and
  ``argmin_b`` is stored for back-substitution. OptCNN states it for one in-edge and one out-edge;
  the algebra never uses the directions, so here any op with exactly two neighbours is folded.
* **Edge elimination** (OptCNN Theorem 2): parallel edges between the same pair of ops are replaced
  by one table, their sum.

Two more rules finish the graph off (OptCNN's reduction ends at a single edge; these make the end
state and graphs with dangling inputs/losses explicit):

* **Leaf folding**: an op ``v`` with a single neighbour ``u`` is folded into ``u``'s node costs,
  ``n'_u(a) = n_u(a) + min_b [E_uv(a, b) + n_v(b)]`` (argmin stored).
* **Isolated op**: an op with no edges takes its cheapest configuration.

The rules are applied until none does. Whatever is left (every op with three or more neighbours) is
enumerated when it has at most 2 ops or at most ``MAX_ENUMERATION`` joint configurations; else
:class:`NotReducible` is raised: the graph is not series-parallel (e.g. a K4 dependency pattern), and
``exact_search`` or ``solve`` should be used instead. Edges are held as full ``K_u x K_v`` matrices
(expanded from the layout-class tables), which is cheap for the zoo's K <= ~60.

Exact: every rewrite preserves the minimum, so the result equals ``exact_search`` on the graphs it
handles (``tests/test_rival_search.py``).
"""

from __future__ import annotations

import math
import time

import numpy as np

from shardplan.cost.tables import CostTables
from shardplan.search.solve import Solution, memory_of

MAX_ENUMERATION = 1_000_000
_CHUNK = 1 << 22  # elements of one K_u x K_v x K_w block in a node elimination


class NotReducible(ValueError):
    """OptCNN's rewrites stop with a graph too large to enumerate; the message says how large."""


def optcnn_search(tables: CostTables) -> Solution:
    """Exact plan by OptCNN's node/edge elimination; raises :class:`NotReducible` on other graphs."""
    start = time.perf_counter()
    n_ops = len(tables.nodes)
    node = [np.asarray(n.total, dtype=np.float64).copy() for n in tables.nodes]
    adj: list[dict[int, None]] = [dict() for _ in range(n_ops)]  # insertion-ordered neighbour sets
    mats: dict[tuple[int, int], np.ndarray] = {}  # (u, w) with u < w -> (K_u, K_w)
    counts = {"node": 0, "edge": 0, "leaf": 0, "isolated": 0}

    def put(u: int, w: int, m: np.ndarray) -> None:
        """Add table m over (u, w); a second table on the same pair is summed (edge elimination)."""
        if u > w:
            u, w, m = w, u, m.T
        key = (u, w)
        if key in mats:
            mats[key] = mats[key] + m
            counts["edge"] += 1
        else:
            mats[key] = np.ascontiguousarray(m)
            adj[u][w] = None
            adj[w][u] = None

    def take(u: int, w: int) -> np.ndarray:
        """Remove the table between u and w, oriented (K_u, K_w)."""
        del adj[u][w], adj[w][u]
        return mats.pop((u, w)) if u < w else mats.pop((w, u)).T

    for e in tables.edges:
        full = e.cost[np.ix_(e.src_class, e.dst_class)].astype(np.float64)
        if e.src == e.dst:
            node[e.src] += np.diagonal(full)  # a self-loop depends on one op only
        else:
            put(e.src, e.dst, full)

    history: list[tuple] = []
    alive = set(range(n_ops))
    work = list(range(n_ops - 1, -1, -1))  # a stack, popped in graph order first
    while work:
        v = work.pop()
        if v not in alive:
            continue
        nb = list(adj[v])
        if len(nb) == 0:
            k = int(np.argmin(node[v]))
            history.append(("isolated", v, k))
            counts["isolated"] += 1
        elif len(nb) == 1:
            (u,) = nb
            t = node[v][:, None] + take(v, u)  # (K_v, K_u)
            arg = np.argmin(t, axis=0)
            node[u] = node[u] + t[arg, np.arange(t.shape[1])]
            history.append(("leaf", v, u, arg))
            counts["leaf"] += 1
            work.append(u)
        elif len(nb) == 2:
            u, w = nb
            a, b = take(u, v), take(v, w)  # (K_u, K_v), (K_v, K_w)
            ku, kv, kw = a.shape[0], a.shape[1], b.shape[1]
            m = np.empty((ku, kw))
            arg = np.empty((ku, kw), dtype=np.int64)
            rows = max(1, _CHUNK // max(kv * kw, 1))
            bv = node[v][:, None] + b  # (K_v, K_w)
            for lo in range(0, ku, rows):
                t = a[lo:lo + rows, :, None] + bv[None, :, :]  # (rows, K_v, K_w)
                arg[lo:lo + rows] = np.argmin(t, axis=1)
                m[lo:lo + rows] = np.take_along_axis(t, arg[lo:lo + rows, None, :], axis=1)[:, 0, :]
            history.append(("node", v, u, w, arg))
            counts["node"] += 1
            put(u, w, m)
            work += [w, u]
        else:
            continue
        alive.discard(v)

    rest = sorted(alive)
    space = math.prod(float(len(node[v])) for v in rest)
    if len(rest) > 2 and space > MAX_ENUMERATION:
        names = [tables.graph.ops[v].name if v < len(tables.graph.ops) else str(v) for v in rest]
        shown = ", ".join(repr(x) for x in names[:6]) + (", ..." if len(names) > 6 else "")
        raise NotReducible(
            f"OptCNN's graph reduction leaves {len(rest)} of {n_ops} ops of {tables.graph.name} "
            f"({shown}), each with 3 or more neighbours, and {space:.3g} joint configurations "
            f"(more than {MAX_ENUMERATION:,} to enumerate): OptCNN handles series-parallel graphs; "
            "use exact_search or solve for this one")
    choice = [-1] * n_ops
    if rest:  # enumerate the remainder with broadcasting over a (K_r1, K_r2, ...) table
        pos = {v: i for i, v in enumerate(rest)}
        shape = tuple(len(node[v]) for v in rest)
        total = np.zeros(shape)
        for v in rest:
            view = [1] * len(rest)
            view[pos[v]] = shape[pos[v]]
            total += node[v].reshape(view)
        for (u, w), m in mats.items():
            view = [1] * len(rest)
            view[pos[u]], view[pos[w]] = shape[pos[u]], shape[pos[w]]
            total += m.reshape(view)  # u < w and rest is sorted, so axes are in order
        best = np.unravel_index(int(np.argmin(total)), shape)
        for v, k in zip(rest, best):
            choice[v] = int(k)
    for step in reversed(history):
        kind, v = step[0], step[1]
        if kind == "isolated":
            choice[v] = step[2]
        elif kind == "leaf":
            choice[v] = int(step[3][choice[step[2]]])
        else:
            choice[v] = int(step[4][choice[step[2]], choice[step[3]]])
    cost = tables.cost_of(choice)
    note = (f"{counts['node']} node eliminations, {counts['edge']} edge eliminations, {counts['leaf']} leaf "
            f"foldings, {counts['isolated']} isolated ops; {len(rest)} ops enumerated "
            f"({space:.3g} joint configurations)")
    return Solution(tuple(choice), cost, True, cost, memory_of(tables, choice), "optcnn",
                    time.perf_counter() - start, 1, note)
