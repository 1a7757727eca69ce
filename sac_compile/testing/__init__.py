"""Fixtures, not the library: ``import sac_compile`` never imports this package.

:data:`PUBLIC` names what the README, the docs and the examples import from here -- small
models to try the library on, the rank runner, an op counter, a hand-written checkpoint
baseline -- and is kept stable like the library's own names (a test holds the README, docs
and examples to it). The other names of these modules serve this project's tests and
benchmarks too and may change without notice; fixtures only the tests and benchmarks use live
in :mod:`._dev`, which the wheel leaves out.

* :mod:`.models` - the small marked transformer, MoE and expert-parallel models;
* :mod:`.hf_families`, :mod:`.hf_vision` - tiny transformers models of many families, built
  from configs;
* :mod:`.ranks` - run a function on N gloo ranks (spawned CPU processes);
* :mod:`.tp` - a Llama stack laid out for tensor parallelism as torchtitan lays it out;
* :mod:`.counting` - count the ops a piece of code dispatches;
* :mod:`.baselines` - hand-written checkpointing baselines.
"""

#: module -> the names of it the README, the docs and the examples use (stable)
PUBLIC: dict[str, tuple[str, ...]] = {
    "models": ("Block", "Stack", "MoETransformer", "EPBlock", "EPStack"),
    "hf_families": ("tiny_llama", "tiny_qwen", "tiny_qwen3_moe"),
    "hf_vision": ("build",),
    "ranks": ("run_ranks",),
    "counting": ("CountOps",),
    "baselines": ("Checkpointed",),
    "tp": ("REGIONS", "LlamaStack", "parallelize"),
}
