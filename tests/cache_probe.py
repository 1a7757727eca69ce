"""Run in a fresh process by test_cache.py: compile once with the caches on, print JSON.

Usage: python -m tests.cache_probe KEEP[,KEEP...] [--plain]   (cache dir from TORCHINDUCTOR_CACHE_DIR)

Also prints what the ``sac_compile`` logger said (INFO and up).
"""

import json
import logging
import sys

import torch
from torch._dynamo.utils import counters

import sac_compile as sc

from .scenarios import TwoRegions


def main() -> None:
    keep = {k for k in sys.argv[1].split(",") if k}
    torch.manual_seed(0)
    model = TwoRegions(8)
    x = torch.randn(4, 8, requires_grad=True)
    packed = []

    def pack(t):
        packed.append([list(t.shape), t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()])
        return t

    logged = []
    handler = logging.Handler(level=logging.INFO)
    handler.emit = lambda r: logged.append([r.levelname, r.getMessage()])
    logger = logging.getLogger("sac_compile")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)

    plain = sys.argv[2:] == ["--plain"]  # plain torch.compile: Inductor without the pass
    with sc.inspection.collect_records() as recs:
        compiled = torch.compile(model) if plain else torch.compile(model, backend=sc.make_sac_backend(keep))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = compiled(x)
        out.sum().backward()
        compiled(x).sum().backward()  # a second step: keep-unused is judged on a repeat
    print(
        json.dumps(
            {
                "autograd_cache_hit": counters["aot_autograd"]["autograd_cache_hit"],
                "autograd_cache_miss": counters["aot_autograd"]["autograd_cache_miss"],
                "pass_ran": len(recs),
                "saved_shapes": sorted(map(str, packed)),
                "grad": float(model.w1.grad.sum()),
                "logged": logged,
            }
        )
    )


if __name__ == "__main__":
    main()
