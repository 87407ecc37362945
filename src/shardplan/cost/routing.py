"""Pricing a routed mixture-of-experts block's experts split: the (token, choice) rows its busiest
group of experts receives, over the mean (its load imbalance), and its token all-to-alls.

A block whose experts are split over ``g`` groups of devices (``capture.moe``: ``experts`` and
``experts_a2a`` together; each device holds a block of ``E / g`` consecutive experts, as
``execute.experts`` assigns them) waits, at its next collective, for the device whose experts got
the most rows. Two sources of that figure:

* **A routing profile** (``moe`` op attributes ``expert_rows``, the rows each sample sent each
  expert, and ``expert_shares``, each expert's fraction of all rows, measured on the model's own
  weights and inputs by ``capture.moe.measure_routing``). The busiest group is then exact for that
  routing. With the batch split ``b`` ways, each tile of ``B / b`` consecutive samples is routed
  on its own devices, and the step waits for the busiest group of any tile:

      load = b g x max over tiles t and blocks j of rows(t, j) / rows(all)
      (rows(t, j): the rows tile t's samples send the experts of block j)

* **No profile** (a model captured on the meta device: no weights, no routing): the expectation
  under uniform routing, each token choosing its ``k`` experts uniformly at random without
  replacement. A group of ``E / g`` experts receives ``X_t`` of token t's choices, hypergeometric
  with mean ``k / g`` and variance ``k (1/g)(1 - 1/g)(E - k)/(E - 1)``; over T tokens the group's
  rows have mean ``mu = T k / g`` and variance ``T`` times that (``sigma^2``). The g counts sum to
  ``T k``, so in the normal approximation they are ``mu + sigma sqrt(g / (g - 1)) (Z_j - mean Z)``
  with ``Z_j`` independent standard normals, and

      E[max rows] = mu + sigma sqrt(g / (g - 1)) c_g        load = E[max rows] / mu

  with ``c_g = E[max of g standard normals]`` (1/sqrt(pi) = 0.564 for g = 2, 1.029 for 4, 1.424
  for 8; Tippett 1925, computed here by quadrature). This is a floor: a trained router, or a
  random one on real tokens, prefers some experts, and its measured profile can be far more
  uneven (the small Mixtral of ``benchmarks/moe_dispatch.py``: 1.00-1.16 on 2 groups where uniform
  routing expects 1.02).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from shardplan.cluster.model import collective_seconds

A2A = "experts_a2a"
"""A mixture-of-experts block's experts split whose tokens move by all-to-all (``capture.moe``)."""


@functools.lru_cache(maxsize=None)
def normal_max(g: int) -> float:
    """E[max of g independent standard normals] (0 for g = 1), by quadrature of
    ``x g phi(x) Phi(x)^(g - 1)`` over [-12, 12]."""
    if g <= 1:
        return 0.0
    x = np.linspace(-12.0, 12.0, 24001)
    phi = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    f = x * g * phi * cdf ** (g - 1)
    return float(np.sum((f[1:] + f[:-1]) * np.diff(x)) / 2.0)


def uniform_load(tokens: float, top_k: int, experts: int, groups: int) -> float:
    """Expected rows of the busiest of ``groups`` expert groups over their mean, for ``tokens`` tokens
    each routed to ``top_k`` distinct experts of ``experts`` uniformly at random (module doc)."""
    g = int(groups)
    if g <= 1 or tokens <= 0 or top_k >= experts:
        return 1.0
    mu = tokens * top_k / g
    var = tokens * top_k * (1.0 / g) * (1.0 - 1.0 / g) * (experts - top_k) / (experts - 1)
    return 1.0 + math.sqrt(var) * math.sqrt(g / (g - 1.0)) * normal_max(g) / mu


def profile_load(shares, groups: int) -> float:
    """Rows of the busiest of ``groups`` blocks of consecutive experts over their mean, for a routing
    profile (each expert's fraction of the rows)."""
    s = np.asarray(shares, dtype=np.float64)
    g = int(groups)
    if g <= 1:
        return 1.0
    if len(s) % g:
        raise ValueError(f"{len(s)} experts do not split into {g} equal groups")
    total = s.sum()
    return float(g * s.reshape(g, -1).sum(axis=1).max() / total) if total > 0 else 1.0


def tile_load(rows_by_sample, tiles: int, groups: int) -> float:
    """Rows of the busiest (batch tile, expert group) over the mean, for the rows each sample sent each
    expert (``(samples, experts)``), the samples cut into ``tiles`` consecutive tiles and the experts
    into ``groups`` blocks of consecutive experts."""
    r = np.asarray(rows_by_sample, dtype=np.float64)
    b, g = int(tiles), int(groups)
    samples, experts = r.shape
    if samples % b or experts % g:
        raise ValueError(f"{samples} samples x {experts} experts do not split into {b} tiles x {g} groups")
    total = r.sum()
    if total <= 0 or b * g == 1:
        return 1.0
    cells = r.reshape(b, samples // b, g, experts // g).sum(axis=(1, 3))
    return float(cells.max() * b * g / total)


def expert_load(op, tokens: np.ndarray, groups: np.ndarray, tiles: np.ndarray | None = None) -> np.ndarray:
    """Per configuration (K,): the busiest expert group's rows over the mean for ``moe`` op ``op`` with
    its experts split ``groups`` ways, its batch ``tiles`` ways and ``tokens`` tokens in each pool the
    groups share (the block's tokens over its batch split): from the op's routing profile when it has
    one (per batch tile when it has the rows of each sample), else uniform routing's expectation."""
    rows, shares = op.attr("expert_rows"), op.attr("expert_shares")
    experts = op.dim("experts").size
    top_k = op.attr("top_k", 1)
    tiles = np.ones(len(groups)) if tiles is None else tiles
    out = np.ones(len(groups))
    for i, (t, g, b) in enumerate(zip(tokens, groups, tiles)):
        if rows:
            out[i] = tile_load(rows, int(b), int(g))
        elif shares:
            out[i] = profile_load(shares, int(g))
        else:
            out[i] = uniform_load(float(t), top_k, experts, int(g))
    return out


def block_load(op, c: np.ndarray) -> np.ndarray:
    """(K,) rows of ``moe`` op ``op``'s busiest expert group over the mean for its configurations
    ``c`` (float, ``(K, dims)``): its experts split ``experts x experts_a2a`` ways share the tokens
    of one batch tile (with a measured profile, the busiest group of the busiest tile)."""
    groups = c[:, op.dim_index("experts")] * (c[:, op.dim_index(A2A)] if A2A in op.dim_names else 1.0)
    tiles = c[:, op.dim_index("batch")]
    tokens = math.prod(op.dim(n).size for n in ("batch", "seq") if n in op.dim_names) / tiles
    return expert_load(op, tokens, groups, tiles)


def token_all_to_all(model, graph, op, configs: np.ndarray, c: np.ndarray, strides) -> tuple[np.ndarray, np.ndarray]:
    """(seconds, forward seconds) of a mixture-of-experts block's token moves under an ``experts_a2a``
    split of ``d`` ways (``capture.moe``; GShard's dispatch, Lepikhin et al. 2021, as
    ``execute.experts`` runs it), priced by ``model`` (an ``AnalyticCostModel``). Forward, each
    device tells every peer how many rows it sends (an all-to-all of ``8 d`` bytes), sends each row's
    expert id (8 bytes a row) and then every (token, choice) row of its own tokens to the device
    holding that expert (dispatch), and gets the rows back through the expert (combine); backward,
    the last two carry the gradients. Rows per device and their bytes ``n``, at the mean:

        rows = x' rows x top_k / e    n = rows x features x dtype bytes
        (x': the device's tile of the block's input, its own tokens; e: the gathered ``experts``
         split, whose other groups take the other ``1 - 1/e`` of the choices)

    each an all-to-all of ``cluster.collective_seconds`` (a device keeps ``1/d`` of its buffer and
    sends the rest). The busiest device's experts get ``load`` times the mean rows
    (``model.expert_load``): it receives that many in the dispatch and sends them back in the
    combine, and the all-to-all lasts as long as its part, so every row move is priced at
    ``load x n``."""
    i, e = op.dim_index(A2A), c[:, op.dim_index("experts")]
    x = graph.tensor(op.inputs[0].tensor)
    n = model.tile_bytes(graph, op, configs, op.inputs[0]) * op.attr("top_k", 1) / e * model.expert_load(op, c)
    rows = n / (x.shape[-1] * x.dtype_bytes)
    q = model.group_levels(configs, strides, [i])

    def a2a(nbytes):
        return collective_seconds(model.cluster, "all_to_all", nbytes, q)
    moves = 2.0 * a2a(n)
    fwd = moves + a2a(8.0 * c[:, i]) + a2a(8.0 * rows)
    on = c[:, i] > 1
    return np.where(on, fwd + moves, 0.0), np.where(on, fwd, 0.0)
