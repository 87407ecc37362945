"""The threaded process group harness (``execute.threaded``) and the re-entrant implicit replication."""

import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("expecttest")

import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from shardplan.execute.apply import implicit_replication  # noqa: E402
from shardplan.execute.threaded import run_threaded  # noqa: E402


def test_each_rank_runs_on_its_own_thread_in_every_run():
    """DTensor's process-wide caches know a mesh by its thread, not its rank: rank r must come back
    on the thread it had in the previous run, and no two ranks may share one. (With fresh threads,
    Mixtral's random plans 14 and 15 on a 2x2 mesh, run one after the other, failed inside an
    all-gather joined by two ranks with tensors of different shapes.)"""
    first = run_threaded(4, lambda rank: threading.get_ident())
    second = run_threaded(4, lambda rank: threading.get_ident())
    assert first == second
    assert len(set(first)) == 4


def test_the_rank_that_failed_is_reported_not_the_ranks_it_stopped():
    def fn(rank):
        if rank == 1:
            raise ValueError("rank 1 broke")
        dist.barrier()  # rank 0 waits here and leaves with SystemExit when rank 1 fails
        return rank

    with pytest.raises(ValueError, match="rank 1 broke"):
        run_threaded(2, fn)
    assert run_threaded(2, lambda rank: rank) == [0, 1]  # the group recovers for the next run


def test_implicit_replication_stays_on_while_any_block_is_open():
    """torch's own context resets a process-wide flag on exit: with the ranks as threads, one rank
    closing its block switched the flag off under a rank still inside. Nested blocks (a forward
    inside the caller's backward block) keep it on too."""
    dispatcher = DTensor._op_dispatcher
    assert dispatcher._allow_implicit_replication is False
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with implicit_replication():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b():
        with implicit_replication():
            b_in.set()
            a_out.wait(10)
            seen["after a left"] = dispatcher._allow_implicit_replication
            with implicit_replication():
                pass
            seen["after a nested block"] = dispatcher._allow_implicit_replication

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    threads[0].start()
    a_in.wait(10)
    threads[1].start()
    for t in threads:
        t.join(10)
    assert seen == {"after a left": True, "after a nested block": True}
    assert dispatcher._allow_implicit_replication is False


def test_a_run_past_its_timeout_is_stopped_and_the_next_run_works():
    """Rank 0 waits in a barrier rank 1 never joins: the run is stopped after its timeout with an
    error naming the rank, and the ranks' threads serve the next run."""
    def fn(rank):
        if rank == 0:
            dist.barrier()
        return rank

    with pytest.raises(TimeoutError, match="rank 0 of 2 did not finish within 1 s"):
        run_threaded(2, fn, timeout=1.0)
    assert run_threaded(2, lambda rank: rank) == [0, 1]


def test_a_rank_still_running_after_a_timeout_stops_before_the_next_run(monkeypatch):
    """Rank 1 sleeps through the timeout and the grace after it, then reaches a collective: it must
    leave there (the run was stopped), and the next run waits for it instead of letting it join the
    next run's collectives."""
    import time

    import shardplan.execute.threaded as threaded

    monkeypatch.setattr(threaded, "_GRACE_SECONDS", 0.1)

    def fn(rank):
        if rank == 1:
            time.sleep(1.5)
        dist.barrier()
        return rank

    with pytest.raises(TimeoutError):
        run_threaded(2, fn, timeout=0.5)
    assert len(threaded._STRAGGLERS) == 1
    assert run_threaded(2, lambda rank: rank) == [0, 1]
    assert threaded._STRAGGLERS == []
