"""Run a function on N gloo ranks (spawned CPU processes): the 2-rank tests and benchmarks.

``run_ranks(fn, *args, world_size=2, timeout=900)`` spawns ``world_size``
processes, initialises a gloo process group in each with a ``file://``
rendezvous in a fresh temporary directory (no port is ever hard-coded), calls
``fn(rank, world_size, *args)`` and returns the ranks' results in rank order.

* A rank that raises fails the call at once with :class:`RankFailed`, whose
  message carries that rank's traceback; the other ranks (possibly blocked in a
  collective) are terminated.
* A rank that dies without reporting (a crash) fails it with its exit code.
* Past ``timeout`` seconds the ranks are terminated and :class:`TimeoutError`
  names the ones still running: a hang never outlives the test. The default is generous
  (a 2-rank compiled test that takes 38 s idle took over 180 s in a CI run that shared
  its 2 cores with other work): a slow machine is slow, not red. A hang is caught by
  ``timeout`` all the same; pass a short one where a test expects one.

``fn`` and its arguments are pickled (spawn), so ``fn`` must be a module-level
function of an importable module. Compile caches are disabled in the ranks, as
in the single-process tests.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["RankFailed", "run_ranks"]


class RankFailed(RuntimeError):
    """A rank raised; the message holds its traceback."""


def _entry(fn: Callable, rank: int, world_size: int, init: str, results: Any, args: tuple) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.compiler.config.force_disable_caches = True
        torch.manual_seed(0)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        except BaseException:
            # reported before the group goes down (which makes the peers fail too)
            results.put((rank, False, traceback.format_exc()))
        finally:
            dist.destroy_process_group()
    except BaseException:  # init or teardown failed
        results.put((rank, False, traceback.format_exc()))


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


def run_ranks(fn: Callable, *args: Any, world_size: int = 2, timeout: float = 900.0) -> list[Any]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="sac_ranks_") as tmp:
        init = f"file://{tmp}/rendezvous"
        results = ctx.Queue()
        procs = [
            ctx.Process(target=_entry, args=(fn, rank, world_size, init, results, args), daemon=True)
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        done: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(done) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r in range(world_size) if r not in done]
                    raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:g} s")
                try:
                    rank, ok, payload = results.get(timeout=min(left, 0.5))
                except queue.Empty:
                    for rank, p in enumerate(procs):
                        if rank not in done and p.exitcode not in (None, 0):
                            raise RankFailed(
                                f"rank {rank} exited with code {p.exitcode} without reporting"
                            ) from None
                    continue
                if not ok:
                    raise RankFailed(_failures(rank, payload, results, world_size))
                done[rank] = payload
        finally:
            for p in procs:
                if p.is_alive() and len(done) < world_size:
                    p.terminate()
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        return [done[r] for r in range(world_size)]
