"""Run a function on N gloo ranks (spawned CPU processes): the 2-rank tests and benchmarks.

``run_ranks(fn, *args, world_size=2, timeout=900)`` calls ``fn(rank, world_size, *args)`` on
``world_size`` processes, each in a gloo process group (a ``file://`` rendezvous in a fresh
temporary directory: no port is ever hard-coded), and returns the ranks' results in rank
order.

* A rank that raises fails the call at once with :class:`RankFailed`, whose
  message carries that rank's traceback; the other ranks (possibly blocked in a
  collective) are terminated.
* A rank that dies without reporting (a crash) fails it with its exit code.
* Past ``timeout`` seconds the ranks are terminated and :class:`TimeoutError`
  names the ones still running: a hang never outlives the call. The default is generous
  (a 2-rank compiled test that takes 38 s idle took over 180 s in a CI run that shared
  its 2 cores with other work): a slow machine is slow, not red. A hang is caught by
  ``timeout`` all the same; pass a short one where a test expects one.

The ranks are kept for the next call of the same ``world_size`` (``reuse=True``, the
default): starting a rank (a spawned interpreter importing torch, a process group, Dynamo's
and AOTAutograd's first imports) costs seconds, which a suite of 2-rank tests would pay per
case. Before each call a kept rank resets Dynamo and seeds 0, as a fresh one does; after a
failure or a timeout the ranks are terminated and the next call starts new ones.
``reuse=False`` starts and ends them around the one call.

``fn`` and its arguments are pickled (spawn), so ``fn`` must be a module-level
function of an importable module. Compile caches are disabled in the ranks, as
in the single-process tests.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["RankFailed", "run_ranks"]


class RankFailed(RuntimeError):
    """A rank raised; the message holds its traceback."""


def _serve(rank: int, world_size: int, init: str, jobs: Any, results: Any) -> None:
    """A rank: join the group, then run each job ``(fn, args)`` from ``jobs`` until ``None``."""
    try:
        import torch
        import torch.distributed as dist

        torch.compiler.config.force_disable_caches = True
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    except BaseException:  # init failed
        results.put((rank, False, traceback.format_exc()))
        return
    try:
        while (job := jobs.get()) is not None:
            fn, args = job
            torch.compiler.reset()
            torch.manual_seed(0)
            try:
                results.put((rank, True, fn(rank, world_size, *args)))
            except BaseException:
                # reported before the group goes down (which makes the peers fail too)
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _failures(rank: int, tb: str, results: Any, world_size: int, grace: float = 3.0) -> str:
    """The first failure, plus any other rank's reported within ``grace`` seconds: a rank
    that raises takes the group down, so its peers fail next with a connection error."""
    failed = {rank: tb}
    end = time.monotonic() + grace
    while len(failed) < world_size and time.monotonic() < end:
        try:
            other, ok, payload = results.get(timeout=max(0.0, end - time.monotonic()))
        except queue.Empty:
            break
        if not ok:
            failed[other] = payload
    return "\n".join(f"rank {r} of {world_size} raised:\n{failed[r]}" for r in sorted(failed))


class _Ranks:
    """``world_size`` serving processes, their job queues and the shared result queue."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tmp = tempfile.mkdtemp(prefix="sac_ranks_")
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world_size)]
        init = f"file://{self.tmp}/rendezvous"
        self.procs = [
            ctx.Process(target=_serve, args=(r, world_size, init, self.jobs[r], self.results), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, args: tuple, timeout: float) -> list[Any]:
        for q in self.jobs:
            q.put((fn, args))
        done: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(done) < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in range(self.world_size) if r not in done]
                raise TimeoutError(
                    f"ranks {missing} of {self.world_size} did not finish within {timeout:g} s"
                )
            try:
                rank, ok, payload = self.results.get(timeout=min(left, 0.5))
            except queue.Empty:
                for rank, p in enumerate(self.procs):
                    if rank not in done and p.exitcode is not None:
                        raise RankFailed(
                            f"rank {rank} exited with code {p.exitcode} without reporting"
                        ) from None
                continue
            if not ok:
                raise RankFailed(_failures(rank, payload, self.results, self.world_size))
            done[rank] = payload
        return [done[r] for r in range(self.world_size)]

    def close(self, graceful: bool) -> None:
        if graceful:
            for q in self.jobs:
                q.put(None)
        for p in self.procs:
            p.join(timeout=10 if graceful else 0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
            if p.is_alive():
                p.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)


_KEPT: dict[int, _Ranks] = {}


@atexit.register
def _close_kept() -> None:
    while _KEPT:
        _KEPT.popitem()[1].close(graceful=True)


def run_ranks(
    fn: Callable, *args: Any, world_size: int = 2, timeout: float = 900.0, reuse: bool = True
) -> list[Any]:
    ranks = _KEPT.pop(world_size, None) if reuse else None
    if ranks is not None and any(p.exitcode is not None for p in ranks.procs):
        ranks.close(graceful=False)
        ranks = None
    ranks = ranks or _Ranks(world_size)
    try:
        out = ranks.run(fn, args, timeout)
    except BaseException:
        ranks.close(graceful=False)
        raise
    if reuse:
        _KEPT[world_size] = ranks
    else:
        ranks.close(graceful=True)
    return out
