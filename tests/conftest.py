import gc
import os

# Inductor's CPU kernels compile scalar in the tests (read when Inductor's config is imported,
# so before torch; inherited by every process a test starts): the same graphs, partitions and
# kernels, half the C++ compile time of vectorized ones, which decided the suite's time on a
# fresh machine (tests/test_backend.py + test_partition_reports.py, empty cache: 85 s, 57 s).
# Set TORCHINDUCTOR_VEC_ISA_OK=1 to test the vectorized kernels.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from sac_compile._compat.inductor import pass_skipping_caches_disabled  # noqa: E402


def pytest_configure(config):
    """Under pytest-xdist (``make test``: one worker per core) each worker computes on one
    thread, and so do the processes it starts (ranks, trainers, fresh interpreters): two
    workers with an OpenMP pool of two threads each on two cores spend the difference
    waiting for each other (tests/test_planning.py + test_peak.py: 131 s, 92 s single-threaded)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_collection_finish(session):
    """The compilers are imported before the first test, so that ``_fresh_compile_state``
    freezes them with the rest of what the tests import (below)."""
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401


@pytest.fixture(autouse=True)
def _fresh_compile_state():
    """Each test compiles from scratch: no Dynamo cache, and no FX-graph/AOTAutograd cache hits.

    A cache hit skips the tagging pass (so no records); the cache tests in
    test_cache.py run in fresh processes with the caches on. Inductor's kernel cache stays
    on (the C++ kernels of identical graphs are built once per run, not once per test).
    """
    torch._dynamo.reset()
    torch.manual_seed(0)
    # What lives between tests (torch, Dynamo, Inductor, transformers: ~700,000 objects) is
    # frozen out of the garbage collector's full collections, after one (no garbage is frozen):
    # at the first test, and after a measurement (autograd_saved_bytes unfreezes the heap).
    # tests/test_hf.py + test_backend.py + test_policy.py: 99 s, 78 s.
    if gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()
    with pass_skipping_caches_disabled():
        yield
    torch._dynamo.reset()


@pytest.fixture
def world_of_one(tmp_path):
    """A single-process gloo group (file:// rendezvous), for collectives in one process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
