"""Every stack of multimodal and encoder-decoder transformers families: what each holds.

One run over the families of ``sac_compile.testing._dev.hf_multimodal`` (tiny random models, hidden
32, two layers a stack, CPU, float32, a batch that runs every stack). For each family:

* per stack S of ``hf.stacks(model)``, the other stacks fully recomputed: S fully
  recomputed, S keeping attention (``config_for(keep={S: {"attn"}})``; a stack without
  attention keeps its first region), S not checkpointed. The ordering every stack should
  show is full < keep attn < not checkpointed;
* the whole model: no checkpoint, transformers' own checkpointing
  (``activation_checkpointing_enable``), ``config_for(keep=())``, ``keep={"attn"}``,
  ``ALL_REGIONS``;
* gradients of ``config_for(keep={"attn"})`` against transformers' own checkpointing:
  eager (max abs difference, expected exactly 0) and, with ``--compiled``, each layer
  compiled with ``aot_eager`` (expected within rtol 1e-4 / atol 1e-5), with Dynamo's graph
  breaks in that run.

Bytes = ``sac_compile.inspection.autograd_saved_bytes`` of ``model(**inputs).loss``,
parameters excluded: what is held for the backward. ``--compiled`` adds a compiled column
(each layer compiled with ``aot_eager``; no checkpoint: the same compile without the tagging
pass). A fresh model is built for every configuration (the same seed: the same weights).
A row that breaks the ordering, a gradient mismatch or a family that fails is flagged
``!`` and the script exits 1.

    python benchmarks/hf_vision_families.py [--families llava,whisper] [--compiled] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

import sac_compile as sc
from sac_compile import hf
from sac_compile.testing._dev import hf_multimodal

_COMPILE = {"inner": "aot_eager"}
Configure = Callable[[nn.Module, bool], None]


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:160] if lines else ''}"


def _reason(message: str) -> str:
    """A graph break's kind and Dynamo's explanation, on one line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    explained = [line.removeprefix("Explanation: ") for line in lines if line.startswith("Explanation:")]
    return ": ".join(lines[:1] + explained[:1])[:200]


def _compile_layers(model: nn.Module, paths: tuple[str, ...]) -> None:
    """Each layer of the stacks at ``paths`` compiled without checkpointing (the baseline)."""
    from sac_compile.compiler.backend import baseline_backend

    for path in paths:
        for layer in model.get_submodule(path):
            layer.compile(backend=baseline_backend("aot_eager"))


def _held(name: str, configure: Configure | None, *, compiled: bool) -> int:
    """Bytes held for the backward by a fresh ``name`` model configured by ``configure``."""
    torch._dynamo.reset()
    model, inputs = hf_multimodal.build(name)
    if configure is not None:
        configure(model, compiled)
    elif compiled:
        _compile_layers(model, hf.stacks(model))

    def loss() -> torch.Tensor:
        torch.manual_seed(0)  # the same dropout masks in every configuration
        return model(**inputs).loss

    return sc.inspection.autograd_saved_bytes(loss, exclude=model.parameters())


def _sac(patterns: tuple[str, ...], regions: dict[str, str], plain: tuple[str, ...] = ()) -> Configure:
    """``SacConfig(layers=patterns)``; the stacks at ``plain`` not checkpointed (compiled
    without the tagging pass in compiled runs)."""

    def configure(model: nn.Module, compiled: bool) -> None:
        if patterns:
            sc.SacConfig(layers=patterns, regions=regions, compile=_COMPILE if compiled else False).apply(
                model
            )
        if compiled:
            _compile_layers(model, plain)

    return configure


def _config_for(keep: Any) -> Configure:
    def configure(model: nn.Module, compiled: bool) -> None:
        hf.config_for(model, keep=keep, compile=_COMPILE if compiled else False).apply(model)

    return configure


def _own_checkpointing(model: nn.Module) -> str:
    """transformers' own checkpointing (``use_reentrant=False``) on every stack; ``""``, or a
    note when the model refuses it and it is switched on its sub-models instead (Pix2Struct's
    encoder and decoder support it, the model does not say so)."""
    kwargs = {"use_reentrant": False}
    try:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        return ""
    except ValueError as e:
        refused = _first_line(e)
    subs = [
        (p, m) for p, m in model.named_modules() if p and getattr(m, "supports_gradient_checkpointing", False)
    ]
    subs = [(p, m) for p, m in subs if not any(p.startswith(f"{q}.") for q, _ in subs)]  # outermost
    for _, m in subs:
        m.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    off = [
        s
        for s in hf.stacks(model)
        if not all(layer.gradient_checkpointing for layer in model.get_submodule(s))
    ]
    if off:
        raise ValueError(f"{refused}; not on {', '.join(off)} through its sub-models")
    return f"switched on {', '.join(p for p, _ in subs)} ({refused})"


def _transformers_own(model: nn.Module, compiled: bool) -> None:
    if compiled:
        raise NotImplementedError("eager only")
    _own_checkpointing(model)


def _step(model: nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _diff(got: tuple, want: tuple) -> dict[str, Any]:
    """Max abs / relative difference of the loss and every gradient; whether all are within
    rtol 1e-4, atol 1e-5 and exactly equal."""
    (loss, grads), (want_loss, want_grads) = got, want
    if grads.keys() != want_grads.keys():
        missing = sorted(set(want_grads) ^ set(grads))
        raise AssertionError(f"gradients of different parameters: {missing[:3]}")
    pairs = [(loss, want_loss)] + [(grads[k], want_grads[k]) for k in want_grads]
    abs_ = max(float((g - w).abs().max()) for g, w in pairs)
    rel = max(float((g - w).abs().max() / w.abs().max().clamp_min(1e-12)) for g, w in pairs)
    close = all(torch.allclose(g, w, rtol=1e-4, atol=1e-5) for g, w in pairs)
    return {"abs": abs_, "rel": rel, "close": close, "equal": all(torch.equal(g, w) for g, w in pairs)}


def _gradients(name: str, compiled: bool) -> dict[str, Any]:
    model, inputs = hf_multimodal.build(name)
    note = _own_checkpointing(model)
    want = _step(model, inputs)
    model, inputs = hf_multimodal.build(name)
    hf.config_for(model, keep={"attn"}).apply(model)
    out = {"eager": _diff(_step(model, inputs), want), "note": note}
    if compiled:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        model, inputs = hf_multimodal.build(name)
        hf.config_for(model, keep={"attn"}, compile=_COMPILE).apply(model)
        try:
            out["compiled"] = _diff(_step(model, inputs), want)
        except Exception as e:  # noqa: BLE001 (the eager check stands; say why this failed)
            out["compiled"] = _first_line(e)
        breaks = counters["graph_break"]
        out["graph_breaks"] = sum(breaks.values())
        out["break_reasons"] = [f"{n} x {_reason(r)}" for r, n in breaks.items()]
    return out


def _family(name: str, modes: list[str]) -> dict[str, Any]:
    model, _ = hf_multimodal.build(name)
    stacks = hf.stacks(model)
    regions = hf.regions_for(model)
    per_stack = {s: [r for p, r in regions.items() if p.startswith(f"{s}.")] for s in stacks}
    patterns = tuple(f"{s}.*" for s in stacks)
    rows: list[dict[str, Any]] = []

    def measure(label: str, configure: Configure | None, stack: str | None = None) -> dict[str, Any]:
        row: dict[str, Any] = {"config": label, "stack": stack}
        for mode in modes:
            try:
                row[mode] = _held(name, configure, compiled=mode == "compiled")
            except NotImplementedError:
                row[mode] = None
            except Exception as e:  # noqa: BLE001 (say which configuration failed, go on)
                row[mode] = _first_line(e)
        rows.append(row)
        return row

    measure("no checkpoint", None)
    measure("transformers' own checkpointing (full)", _transformers_own)
    measure("config_for(keep=())", _config_for(()))
    measure('config_for(keep={"attn"})', _config_for({"attn"}))
    measure("config_for(keep=ALL_REGIONS)", _config_for(sc.ALL_REGIONS))
    full = measure("every stack full recompute", _sac(patterns, regions))
    rows.pop()  # shown in each stack's rows
    broken = []
    for stack, pattern in zip(stacks, patterns):
        kept = "attn" if "attn" in per_stack[stack] else per_stack[stack][0]
        others = tuple(p for p in patterns if p != pattern)
        rows.append(dict(full, config="full recompute", stack=stack))
        attn = measure(f"keep {{{kept!r}}}", _config_for({stack: {kept}}), stack)
        plain = measure("not checkpointed", _sac(others, regions, plain=(stack,)), stack)
        for mode in modes:
            values = [full[mode], attn[mode], plain[mode]]
            if not all(isinstance(v, int) for v in values):
                continue  # a configuration that failed: flagged as such
            ok = values[0] < values[1] < values[2]
            plain[f"{mode} ordering"] = ok
            if not ok:
                broken.append(
                    f"{stack} ({mode}): full {values[0]:,}, keep {kept} {values[1]:,}, not checkpointed {values[2]:,}"
                )
    return {"stacks": {s: sorted(set(r)) for s, r in per_stack.items()}, "rows": rows, "broken": broken}


def _bytes(v: Any, none: Any) -> str:
    if v is None:
        return "—"
    if not isinstance(v, int):
        return f"! {v}"
    ratio = f" ({v / none:.2f})" if isinstance(none, int) and none else ""
    return f"{v:,}{ratio}"


def _print_family(name: str, result: dict[str, Any], modes: list[str]) -> None:
    stacks = ", ".join(f"`{s}` ({', '.join(r)})" for s, r in result["stacks"].items())
    print(f"\n### {name}\n\nstacks: {stacks}\n")
    header = " | ".join(f"{m} bytes (/ no ckpt)" for m in modes)
    print(f"| stack | configuration | {header} | ordering |")
    print("|---|---|" + "---:|" * len(modes) + "---|")
    none = {m: result["rows"][0][m] for m in modes}
    for row in result["rows"]:
        stack = f"`{row['stack']}`" if row["stack"] else "(all)"
        cells = " | ".join(_bytes(row[m], none[m]) for m in modes)
        checks = [row[f"{m} ordering"] for m in modes if f"{m} ordering" in row]
        ordering = "" if not checks else ("ok" if all(checks) else "!")
        print(f"| {stack} | {row['config']} | {cells} | {ordering} |")
    for m in modes:  # the whole model, for information (not flagged)
        b = {row["config"]: row[m] for row in result["rows"] if row["stack"] is None}
        full, attn, every = (
            b["config_for(keep=())"],
            b['config_for(keep={"attn"})'],
            b["config_for(keep=ALL_REGIONS)"],
        )
        if all(isinstance(v, int) for v in (full, attn, every, none[m])):
            ok = full < attn < every <= none[m]
            print(
                f"\nwhole model ({m}): keep=() < keep attn < ALL_REGIONS <= no checkpoint: {'yes' if ok else 'no'}"
            )
    grads = result.get("gradients")
    if isinstance(grads, dict):
        e = grads["eager"]
        line = f"\ngradients, keep={{'attn'}} vs transformers' own: eager max abs diff {e['abs']:.3g}"
        line += "" if e["equal"] else " !"
        c = grads.get("compiled")
        if isinstance(c, str):
            line += f"; compiled ! {c}"
        elif c is not None:
            line += f"; compiled max abs diff {c['abs']:.3g} (rel {c['rel']:.3g}){'' if c['close'] else ' !'}"
        if "graph_breaks" in grads:
            line += f"; graph breaks {grads['graph_breaks']}"
            if grads["break_reasons"]:
                line += f" ({'; '.join(grads['break_reasons'][:2])})"
        print(line)
        if grads["note"]:
            print(f"\ntransformers' own checkpointing: {grads['note']}")
    elif grads is not None:
        print(f"\ngradients: ! {grads}")
    for b in result["broken"]:
        print(f"! ordering full < keep < not checkpointed broken: {b}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--families", default=",".join(hf_multimodal.FAMILIES), help="comma-separated (default: all)"
    )
    parser.add_argument("--compiled", action="store_true", help="also compiled per layer (aot_eager): slower")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    # sac_compile's one-time notes that each layer's cache is off while it is checkpointed
    logging.getLogger("sac_compile").setLevel(logging.ERROR)
    modes = ["eager", "compiled"] if args.compiled else ["eager"]
    print(
        f"## Every stack of transformers families ({datetime.date.today().isoformat()}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}, Python {platform.python_version()}, CPU, float32, "
        f"{torch.get_num_threads()} thread(s))\n\n"
        "Tiny random models (hidden 32, two layers a stack), one batch that runs every stack. Bytes held for the "
        "backward per forward (autograd_saved_bytes, parameters excluded), ratio to the same mode's no checkpoint. "
        "Per stack: the other stacks fully recomputed; the ordering full < keep attn < not checkpointed."
    )
    results, flags = {}, []
    for name in args.families.split(","):
        start = time.perf_counter()
        torch._dynamo.reset()
        try:
            result = _family(name, modes)
        except Exception as e:  # noqa: BLE001 (a family that fails: say so, go on)
            print(f"\n### {name}\n\n! failed: {_first_line(e)}")
            results[name] = {"error": _first_line(e)}
            flags.append(f"{name}: failed ({_first_line(e)})")
            continue
        try:
            result["gradients"] = _gradients(name, args.compiled)
        except Exception as e:  # noqa: BLE001
            result["gradients"] = _first_line(e)
        result["seconds"] = round(time.perf_counter() - start, 1)
        _print_family(name, result, modes)
        print(f"\n({result['seconds']} s)")
        results[name] = result
        for m in modes:
            errors = [r[m] for r in result["rows"] if isinstance(r[m], str)]
            if errors:
                flags.append(f"{name}: {len(errors)} {m} configuration(s) failed, first: {errors[0]}")
        flags += [f"{name}: ordering {b}" for b in result["broken"]]
        grads = result["gradients"]
        if not isinstance(grads, dict):
            flags.append(f"{name}: gradient check failed ({grads})")
        else:
            if not grads["eager"]["equal"]:
                flags.append(f"{name}: eager gradients differ by {grads['eager']['abs']:.3g}")
            comp = grads.get("compiled")
            if isinstance(comp, str):
                flags.append(f"{name}: compiled gradient check failed ({comp})")
            elif comp is not None and not comp["close"]:
                flags.append(
                    f"{name}: compiled gradients differ by {comp['abs']:.3g} (rel {comp['rel']:.3g})"
                )
    print("\n## Summary\n")
    print("| family | stacks | eager grad diff | compiled grad diff | graph breaks | flags |")
    print("|---|---:|---:|---:|---:|---|")
    for name, r in results.items():
        grads = r.get("gradients")
        n_flags = sum(f.startswith(f"{name}:") for f in flags)
        if "error" in r or not isinstance(grads, dict):
            print(f"| {name} | | | | | ! {r.get('error') or grads} |")
            continue
        comp = grads.get("compiled", "—")
        comp = f"{comp['abs']:.3g}" if isinstance(comp, dict) else comp if comp == "—" else "! failed"
        print(
            f"| {name} | {len(r['stacks'])} | {grads['eager']['abs']:.3g} | "
            f"{comp} | {grads.get('graph_breaks', '—')} | "
            f"{'! ' + str(n_flags) if n_flags else ''} |"
        )
    print("\n" + ("no flags" if not flags else "flags:\n" + "\n".join(f"! {f}" for f in flags)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 1 if flags else 0


if __name__ == "__main__":
    sys.exit(main())
