"""Exhaustive search over every assignment: the oracle for tests on tiny graphs."""

from __future__ import annotations

import itertools

from shardplan.cost.tables import CostTables


def brute_force(tables: CostTables, limit: int = 2_000_000) -> tuple[tuple[int, ...], float]:
    """Best assignment and its cost by trying all of them; refuses more than ``limit`` assignments."""
    total = 1
    for k in tables.num_configs:
        total *= k
    if total > limit:
        raise ValueError(f"brute force would try {total} assignments (limit {limit})")
    best, best_cost = None, float("inf")
    for choice in itertools.product(*(range(k) for k in tables.num_configs)):
        c = tables.cost_of(choice)
        if c < best_cost:
            best, best_cost = choice, c
    return best, best_cost
