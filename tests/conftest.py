import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_compile_state():
    """Each test compiles from scratch: no Dynamo cache, and no FX-graph/AOTAutograd cache hits.

    A cache hit skips the tagging pass (so no records); the cache tests in
    test_cache.py run in fresh processes with the caches on.
    """
    torch._dynamo.reset()
    torch.manual_seed(0)
    with torch.compiler.config.patch(force_disable_caches=True):
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
