"""What torchtitan 0.3.0 needs to train on a CPU: shims, synthetic assets, a CPU config.

torchtitan targets GPUs and torch nightlies. None of this is needed on a GPU with the
torch release torchtitan asks for; the plugin (``sac_compile_ac.py``) does not depend
on any of it. Each shim is one function, named for what it works around:

* ``device_is_cpu``: ``torchtitan.tools.utils`` picks the accelerator with
  ``torch._utils._get_available_device_type() or "cuda"`` at import, so on a machine
  without one it asks for CUDA. The shim sets ``device_type = "cpu"`` and a device
  module with the handful of calls torchtitan makes (``set_device``,
  ``memory_stats``, ...), before any other torchtitan module binds the names.
* ``gpu_kernels_absent``: ``torchtitan.distributed.minimal_async_ep.kernels`` imports
  ``triton`` at module level (Triton kernels of its expert-parallel dispatch, never
  run by a dense model). Where ``triton`` is not installed (the CPU wheel of torch),
  the module is replaced by one whose names raise when *called*.
* ``set_timeout_alias``: the trainer calls ``torch.distributed.set_timeout`` after the
  first step, which torch < 2.15 does not have; the alias sets the timeout of a gloo
  group the way that call does (``_set_default_timeout`` of its backend).

``write_assets(folder)`` writes a word-level tokenizer (``tokenizer.json`` of the
``tokenizers`` library, 2,048 ids: the debug model's vocabulary) and a JSON-lines text
corpus, standing in for the ``tests/assets`` folder of torchtitan's repository (not in
its wheel). ``llama3_debugmodel_cpu`` is torchtitan's ``llama3_debugmodel`` with
SDPA instead of FlexAttention (no CPU backward for the latter here), shorter
sequences, the assets above, and no validation or checkpoint saving; pass this module
as ``--module`` and the function as ``--config``.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import random
import sys
import tempfile
import types

import torch

ASSETS_ENV = "SAC_TORCHTITAN_ASSETS"  # where write_assets put the tokenizer and corpus
LAYERS_ENV = "SAC_TORCHTITAN_LAYERS"  # optional: N layers (the debug model's first N, or more)
VOCAB = 2048  # torchtitan's debug model: vocab_size=2048


def _cpu_device_module() -> types.ModuleType:
    module = types.ModuleType("sac_torchtitan_cpu_device")
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    module.set_device = lambda device: None
    module.current_device = lambda: 0
    module.device_count = lambda: 1
    module.synchronize = lambda device=None: None
    module.empty_cache = lambda: None
    module.reset_peak_memory_stats = lambda device=None: None
    module.memory_stats = lambda device=None: {}
    module.get_device_name = lambda device=None: "cpu"
    module.get_device_properties = lambda device=None: types.SimpleNamespace(name="cpu", total_memory=total)
    module.is_available = lambda: True
    return module


def device_is_cpu() -> None:
    if "torchtitan.trainer" in sys.modules:
        raise RuntimeError("cpu.install() must run before torchtitan.trainer is imported")
    import torchtitan.tools.utils as utils

    utils.device_type = "cpu"
    utils.device_module = _cpu_device_module()


def gpu_kernels_absent() -> None:
    if importlib.util.find_spec("triton") is not None:
        return
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    stub = types.ModuleType(name)

    def __getattr__(attr: str):
        if attr.startswith("__"):  # module protocol (``__file__``, ...): absent, as on any module
            raise AttributeError(attr)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{name}.{attr} is a Triton GPU kernel; triton is not installed")

        return unavailable

    stub.__getattr__ = __getattr__
    sys.modules[name] = stub


def set_timeout_alias() -> None:
    import torch.distributed as dist

    if hasattr(dist, "set_timeout"):
        return

    def set_timeout(timeout, group=None):
        group = group or dist.distributed_c10d._get_default_group()
        group._get_backend(torch.device("cpu"))._set_default_timeout(timeout)  # gloo's

    dist.set_timeout = set_timeout


def install() -> None:
    """Every shim above, in the order they must run (before importing torchtitan.trainer)."""
    device_is_cpu()
    gpu_kernels_absent()
    set_timeout_alias()


def prepare() -> None:
    """What both launchers do before torchtitan starts: the shims, the assets (once per
    process tree: ``SAC_TORCHTITAN_ASSETS``), and a single-process rendezvous where no
    launcher (torchrun) set one."""
    install()
    if not os.environ.get(ASSETS_ENV):
        os.environ[ASSETS_ENV] = write_assets(tempfile.mkdtemp(prefix="sac-torchtitan-"))
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))


def write_assets(folder: str) -> str:
    """A tokenizer and a text corpus under ``folder`` (idempotent); returns ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer_dir = os.path.join(folder, "tokenizer")
    corpus_dir = os.path.join(folder, "corpus")
    os.makedirs(tokenizer_dir, exist_ok=True)
    os.makedirs(corpus_dir, exist_ok=True)
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<unk>"]
    words = [f"w{i}" for i in range(VOCAB - len(specials))]
    vocab = {token: i for i, token in enumerate(specials + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(os.path.join(tokenizer_dir, "tokenizer.json"))
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": specials[0], "eos_token": specials[1], "add_bos_token": True}, f)
    rng = random.Random(0)  # a corpus with structure to learn: words follow in runs
    with open(os.path.join(corpus_dir, "train.json"), "w") as f:
        for _ in range(400):
            start = rng.randrange(len(words))
            text = " ".join(words[(start + 3 * i) % len(words)] for i in range(rng.randrange(200, 400)))
            f.write(json.dumps({"text": text}) + "\n")
    return folder


def _for_cpu(config, seq_len: int):
    """``config`` (a torchtitan ``Trainer.Config``) set up for a CPU: SDPA in every block (MTP
    layers too; torchtitan refuses ``attn_backend="sdpa"`` by name), the first
    ``SAC_TORCHTITAN_LAYERS`` blocks if set, the assets of :func:`write_assets`, no validation
    or checkpoint saving."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    folder = os.environ.get(ASSETS_ENV)
    if not folder:
        raise RuntimeError(f"set {ASSETS_ENV} to a folder cpu.write_assets wrote (the launcher does)")
    model = config.model_spec.model
    layers = os.environ.get(LAYERS_ENV)
    if layers:  # fewer layers, or more: copies of the last one (real depth: Dynamo's recompile limit is 8)
        n = int(layers)
        del model.layers[n:]
        model.layers.extend(copy.deepcopy(model.layers[-1]) for _ in range(n - len(model.layers)))
    for block in [*model.layers, *(getattr(model, "mtp_layers", None) or [])]:
        block.attention.inner_attention = ScaledDotProductAttention.Config()
    config.hf_assets_path = os.path.join(folder, "tokenizer")
    config.dataloader.dataset_path = os.path.join(folder, "corpus")
    config.training.seq_len = seq_len
    config.training.local_batch_size = 2
    config.training.steps = 4
    config.validator.enable = False
    config.checkpoint.enable = False
    config.metrics.enable_tensorboard = False
    return config


def llama3_debugmodel_cpu():
    """torchtitan's ``llama3_debugmodel`` sized and set up for a CPU (see the module docstring)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    return _for_cpu(llama3_debugmodel(), 256)


def _moe_for_cpu(config, seq_len: int):
    """:func:`_for_cpu`, float32: single-device torchtitan trains under ``torch.autocast`` with
    ``mixed_precision_param`` (bfloat16 by default), whose matmuls this CPU runs emulated
    (about 20 s a step for the MoE debug models, 5 s in float32)."""
    config = _for_cpu(config, seq_len)
    config.training.mixed_precision_param = "float32"
    return config


def deepseek_v3_debugmodel_cpu():
    """torchtitan's ``deepseek_v3_debugmodel`` (a dense first block, then MoE blocks: 8 routed
    experts top-3 and shared experts), SDPA, seq 128, float32."""
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    return _moe_for_cpu(deepseek_v3_debugmodel(), 128)


def deepseek_v3_debugmodel_mtp_cpu():
    """``deepseek_v3_debugmodel_mtp``: the above with one multi-token-prediction layer and
    ``MTPLoss``."""
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel_mtp

    return _moe_for_cpu(deepseek_v3_debugmodel_mtp(), 128)


def qwen3_moe_debug_cpu():
    """torchtitan's ``qwen3_moe_debug`` (every block an MoE: 64 experts top-8, no shared
    experts), SDPA, seq 128, float32."""
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    return _moe_for_cpu(qwen3_moe_debug(), 128)
