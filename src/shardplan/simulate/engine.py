"""The discrete-event engine: tasks on streams, replayed event by event with a heap.

A **task** has a duration (seconds), the tasks it waits for (``deps``), and the *lanes* it occupies
while it runs: ``(device, stream)`` pairs. A compute kernel occupies one lane, ``(d, "compute")``; a
collective occupies the comm lane of every member of its group, so it starts only when its inputs
are ready **and** every member's comm stream is free (the contention model: a device's comm stream
runs one collective at a time; a collective holds all its members' streams from start to end).

Each lane serves its tasks in one of two ways:

* ``greedy`` (default): when the lane is free, it starts the ready task with the smallest
  ``(priority, id)`` (critical work has priority 0, overlappable work 1; ids are program order).
  This is list scheduling, non-preemptive: a started task runs to its end.
* ``strict``: the lane runs its tasks exactly in id order (a pipeline stage's schedule).

``serial`` lanes merge streams: the builder maps several streams of a device onto one *resource*
(``overlap=False``), so nothing on that device overlaps. Memory: a task may allocate bytes on its
devices when it starts and free bytes when it ends; the engine tracks every device's memory in time
order (frees at an instant before allocations at that instant) and reports the peak.

Run time is O(T log T + T * ready) for T tasks; a few microseconds per task.
"""

from __future__ import annotations

import heapq
from bisect import insort
from dataclasses import dataclass, field


@dataclass
class Task:
    name: str
    duration: float
    lanes: tuple[tuple[int, str], ...]
    deps: list[int] = field(default_factory=list)
    priority: int = 0
    kind: str = "compute"  # compute | comm (colour and statistics)
    alloc: tuple[tuple[int, float], ...] = ()  # (device, bytes) allocated at the start
    free: tuple[tuple[int, float], ...] = ()  # (device, bytes) freed at the end


@dataclass(frozen=True)
class Event:
    """One executed task on one lane (a collective gives one event per member)."""

    device: int
    stream: str
    name: str
    start: float
    end: float
    kind: str = "compute"


class TaskGraph:
    """Tasks added in program order; ``run`` replays them. See the module doc for the rules."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []
        self.strict: set[tuple[int, str]] = set()
        self.resource_of: dict[tuple[int, str], object] = {}
        self.static_bytes: dict[int, float] = {}

    def add(self, name: str, duration: float, lanes, deps=(), *, priority: int = 0, kind: str = "compute",
            alloc=(), free=()) -> int:
        if not duration >= 0:
            raise ValueError(f"task {name!r}: duration must be non-negative, got {duration!r}")
        lanes = tuple(lanes)
        if not lanes:
            raise ValueError(f"task {name!r} occupies no lane")
        self.tasks.append(Task(name, float(duration), lanes, [d for d in deps if d is not None], priority,
                               kind, tuple(alloc), tuple(free)))
        return len(self.tasks) - 1

    def add_dep(self, task: int, dep: int) -> None:
        self.tasks[task].deps.append(dep)

    def set_strict(self, lane: tuple[int, str]) -> None:
        """Run ``lane``'s tasks exactly in program (id) order."""
        self.strict.add(lane)

    def merge(self, lane: tuple[int, str], resource) -> None:
        """Lanes mapped to the same ``resource`` never run two tasks at once (``overlap=False``)."""
        self.resource_of[lane] = resource

    def run(self) -> tuple[float, list[Event], dict[int, float], float]:
        """Replay: (makespan, events in start order, peak memory per device, dependency bound).

        The dependency bound is the longest chain of dependent tasks, streams ignored: a lower bound
        on the makespan."""
        tasks = self.tasks
        n = len(tasks)
        succ: list[list[int]] = [[] for _ in range(n)]
        indeg = [0] * n
        for i, t in enumerate(tasks):
            for d in t.deps:
                if not 0 <= d < n:
                    raise ValueError(f"task {t.name!r} waits for unknown task {d}")
                succ[d].append(i)
                indeg[i] += 1
        res_index: dict[object, int] = {}
        task_res: list[tuple[int, ...]] = []
        for t in tasks:
            rs = []
            for lane in t.lanes:
                key = self.resource_of.get(lane, lane)
                r = res_index.setdefault(key, len(res_index))
                if r not in rs:
                    rs.append(r)
            task_res.append(tuple(rs))
        busy = [False] * len(res_index)
        # strict resources: their task ids in order and a pointer to the next one
        strict_seq: dict[int, list[int]] = {}
        for lane in self.strict:
            key = self.resource_of.get(lane, lane)
            if key in res_index:
                strict_seq.setdefault(res_index[key], [])
        for i, rs in enumerate(task_res):
            for r in rs:
                if r in strict_seq:
                    strict_seq[r].append(i)
        strict_ptr = {r: 0 for r in strict_seq}

        R = len(res_index)
        heaps: list[list[tuple[int, int]]] = [[] for _ in range(R)]  # ready one-lane tasks per resource
        multi: list[tuple[int, int]] = []  # ready tasks on several resources (collectives), sorted
        prio = [t.priority for t in tasks]

        def make_ready(i: int) -> None:
            rs = task_res[i]
            if len(rs) == 1:
                heapq.heappush(heaps[rs[0]], (prio[i], i))
            else:
                insort(multi, (prio[i], i))

        for i in range(n):
            if indeg[i] == 0:
                make_ready(i)
        running: list[tuple[float, int]] = []
        start = [0.0] * n
        started = [False] * n
        done = 0
        now = 0.0
        mem_deltas: list[tuple[float, int, int, float]] = []  # (time, order, device, delta)

        def launch(i: int) -> None:
            for r in task_res[i]:
                busy[r] = True
            start[i] = now
            started[i] = True
            t = tasks[i]
            for dev, b in t.alloc:
                mem_deltas.append((now, 1, dev, b))
            heapq.heappush(running, (now + t.duration, i))

        while True:
            if multi:  # a collective starts when all its resources are free and no readier task wants them
                keep = []
                for key in multi:
                    i = key[1]
                    ok = True
                    for r in task_res[i]:
                        seq = strict_seq.get(r)
                        if busy[r] or (seq is not None and seq[strict_ptr[r]] != i) or (
                                seq is None and heaps[r] and heaps[r][0] < key):
                            ok = False
                            break
                    if ok:
                        launch(i)
                    else:
                        keep.append(key)
                multi = keep
            for r in range(R):
                h = heaps[r]
                if busy[r] or not h:
                    continue
                seq = strict_seq.get(r)
                if seq is not None:
                    if seq[strict_ptr[r]] != h[0][1]:
                        continue  # the next task in order is not ready yet
                launch(heapq.heappop(h)[1])
            if not running:
                break
            end, i = heapq.heappop(running)
            finished = [i]
            while running and running[0][0] == end:
                finished.append(heapq.heappop(running)[1])
            now = end
            for i in finished:
                done += 1
                for r in task_res[i]:
                    busy[r] = False
                    if r in strict_ptr:
                        strict_ptr[r] += 1
                for dev, b in tasks[i].free:
                    mem_deltas.append((now, 0, dev, -b))
                for s_ in succ[i]:
                    indeg[s_] -= 1
                    if indeg[s_] == 0:
                        make_ready(s_)
        if done != n:
            stuck = next((t.name for i, t in enumerate(tasks) if not started[i]), "?")
            raise RuntimeError(f"task graph deadlocked or has a cycle: {n - done} tasks never ran (e.g. {stuck!r})")
        events = []
        order = sorted(range(n), key=lambda i: (start[i], i))
        makespan = 0.0
        chain = [0.0] * n
        for i in order:  # start order is a topological order
            t = tasks[i]
            e = start[i] + t.duration
            makespan = max(makespan, e)
            chain[i] = max((chain[d] for d in t.deps), default=0.0) + t.duration
            for dev, stream in t.lanes:
                events.append(Event(dev, stream, t.name, start[i], e, t.kind))
        mem_deltas.sort()
        level = dict(self.static_bytes)
        peak = dict(self.static_bytes)
        for _, _, dev, delta in mem_deltas:
            level[dev] = level.get(dev, 0.0) + delta
            if level[dev] > peak.get(dev, 0.0):
                peak[dev] = level[dev]
        return makespan, events, peak, max(chain, default=0.0)
