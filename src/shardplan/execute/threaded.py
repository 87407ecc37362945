"""Run a function on N ranks as threads of this process (torch's threaded process group).

Fast enough for unit tests of distributed numerics: no process start-up, no sockets. The ranks share
the global RNG, so draw data from a private ``torch.Generator``.
"""

from __future__ import annotations

import threading

import torch.distributed as dist
from torch._C._distributed_c10d import _set_thread_isolation_mode
from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup, _install_threaded_pg


def run_threaded(world_size: int, fn):
    """``[fn(rank) for rank in ranks]`` with a ``threaded`` process group of ``world_size`` around each."""
    _set_thread_isolation_mode(True)
    ProcessLocalGroup.reset()  # a failed earlier run leaves its termination flag set
    try:
        world = _install_threaded_pg()
        store = dist.HashStore()
        results: list = [None] * world_size
        errors: list = []

        def worker(rank):
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001 - reported to the caller below
                errors.append((rank, exc))
                ProcessLocalGroup.exception_handle(exc)
            finally:
                if world == dist.distributed_c10d._world:
                    dist.destroy_process_group()

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        if errors:
            rank, exc = sorted(errors, key=lambda e: e[0])[0]
            raise exc
        return results
    finally:
        _set_thread_isolation_mode(False)
