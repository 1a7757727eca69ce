"""torchtitan's own ``torchtitan.train`` on a CPU: the shims of ``cpu.py``, then its ``main()``.

    python examples/torchtitan/train.py --module cpu --config llama3_debugmodel_cpu \\
        --override.imports sac_compile_ac.sac_compile
    torchrun --nproc-per-node 2 examples/torchtitan/train.py ... --parallelism.tensor-parallel-degree 2 \\
        --parallelism.spmd-backend full_dtensor

Every argument is torchtitan's. This folder is put on ``sys.path`` so ``--module cpu`` and
``sac_compile_ac`` import; without torchrun, the single-process rendezvous is set here.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import cpu  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    cpu.prepare()
    from torchtitan.train import main as torchtitan_main

    sys.argv = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    torchtitan_main()


if __name__ == "__main__":
    main()
