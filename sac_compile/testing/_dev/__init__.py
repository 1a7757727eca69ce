"""This project's own test fixtures: what only its tests and benchmarks use. Not in the wheel
(``pyproject.toml`` excludes the package; ``tests/test_packaging.py`` checks it), never
imported by :mod:`sac_compile.testing`'s public modules, and free to change.

* :mod:`.hf_multimodal`, :mod:`.hf_encoders` - tiny vision-language, audio and seq2seq
  transformers models of many families, built from configs (every stack of a model);
* :mod:`.method_compiled` - a trainer's layout: methods compiled inside a checkpoint.
"""
