"""Run a function on N ranks as threads of this process (torch's threaded process group).

Fast enough for unit tests of distributed numerics: no process start-up, no sockets. The ranks share
the global RNG, so draw data from a private ``torch.Generator``.

Rank ``r`` of a world of ``n`` always runs on the same long-lived thread. DTensor keeps process-wide
caches keyed by the device mesh, and a mesh's identity holds the thread it was made on but not its
rank (torch 2.13). With fresh threads per run, the operating system hands a finished run's thread
ids to the next run's threads in any order, so rank 2 could be served a redistribution planned for
rank 0's mesh of an earlier run: two ranks then met in one all-gather with tensors of different
shapes, in about 2 of 100 random plans run back to back. One thread per rank keeps every cached
entry with the rank that made it.
"""

from __future__ import annotations

import queue
import threading
import time

import torch.distributed as dist
from torch._C._distributed_c10d import _set_thread_isolation_mode
from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup, _install_threaded_pg

_POOLS: dict[int, list[queue.Queue]] = {}
_POOL_LOCK = threading.Lock()
_STRAGGLERS: list[threading.Event] = []  # the unfinished ranks of runs that timed out
_GRACE_SECONDS = 10.0  # how long a timed-out run's ranks get to stop before their threads are given up


def _serve(tasks: queue.Queue) -> None:
    while True:
        job = tasks.get()
        job()


def _rank_queues(world_size: int) -> list[queue.Queue]:
    """One task queue per rank, each served by its own daemon thread for the life of the process."""
    with _POOL_LOCK:
        if world_size not in _POOLS:
            queues = [queue.Queue() for _ in range(world_size)]
            for rank, q in enumerate(queues):
                threading.Thread(target=_serve, args=(q,), name=f"rank {rank} of {world_size}", daemon=True).start()
            _POOLS[world_size] = queues
        return _POOLS[world_size]


def run_threaded(world_size: int, fn, timeout: float = 300.0):
    """``[fn(rank) for rank in ranks]`` with a ``threaded`` process group of ``world_size`` around each."""
    # ranks of a timed-out run still computing would join this run's collectives once the
    # termination flag is cleared: wait for them to stop, or refuse
    for event in _STRAGGLERS:
        if not event.wait(timeout):
            raise RuntimeError(f"a rank thread of an earlier run is still running after {timeout:.0f} s more; "
                               "start a new process for further threaded runs")
    _STRAGGLERS.clear()
    _set_thread_isolation_mode(True)
    ProcessLocalGroup.reset()  # a failed earlier run leaves its termination flag set
    try:
        world = _install_threaded_pg()
        store = dist.HashStore()
        results: list = [None] * world_size
        errors: list = []
        done = [threading.Event() for _ in range(world_size)]

        def worker(rank):
            try:
                dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
                try:
                    results[rank] = fn(rank)
                except BaseException as exc:  # noqa: BLE001 - reported to the caller below
                    errors.append((rank, exc))
                    ProcessLocalGroup.exception_handle(exc)
                finally:
                    if world == dist.distributed_c10d._world:
                        dist.destroy_process_group()
            except BaseException as exc:  # noqa: BLE001 - the group's set-up or tear-down
                errors.append((rank, exc))
            finally:
                done[rank].set()

        for rank, q in enumerate(_rank_queues(world_size)):
            q.put(lambda rank=rank: worker(rank))
        deadline = time.monotonic() + timeout
        for rank, event in enumerate(done):
            if not event.wait(max(deadline - time.monotonic(), 0.0)):
                # stop the ranks waiting in a collective; threads still busy after that are given up
                # (the next run of this world size gets fresh ones, once they have stopped)
                ProcessLocalGroup.exception_handle(TimeoutError())
                if not all(e.wait(_GRACE_SECONDS) for e in done):
                    with _POOL_LOCK:
                        _POOLS.pop(world_size, None)
                    _STRAGGLERS.extend(e for e in done if not e.is_set())
                raise TimeoutError(f"rank {rank} of {world_size} did not finish within {timeout:.0f} s")
        if errors:
            # a rank that fails sets the group's termination flag, and the ranks waiting in a collective
            # leave with SystemExit("Test termination event occurs."): report the failure itself
            real = [e for e in errors if not isinstance(e[1], SystemExit)] or errors
            rank, exc = sorted(real, key=lambda e: e[0])[0]
            raise exc
        return results
    finally:
        _set_thread_isolation_mode(False)
