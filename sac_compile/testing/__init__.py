"""Fixtures, not the library: ``import sac_compile`` never imports this package.

* :mod:`.models` - the small marked transformer, MoE and expert-parallel models of the
  demo, the benchmarks and the tests;
* :mod:`.ranks` - run a function on N gloo ranks (spawned CPU processes);
* :mod:`.parity` - eager vs compiled saved bytes per region;
* :mod:`.counting` - count the ops a piece of code dispatches.
"""
