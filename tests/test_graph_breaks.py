"""Whole-model compile: a wrapped layer's keep set survives graph breaks; only wrapped code is
checkpointed; containers cannot be wrapped.

A graph break inside a wrapped layer makes Dynamo compile the frames below it one by one.
Each piece must keep the layer's scope and keep set (read from the Python stack) and the
regions that were open when the break happened (a declared module's hooks, a decorated
function), exactly as when the layer is compiled on its own; code outside every wrapped
layer (the loss after a break) is left to the partitioner, untagged.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn as nn

import sac_compile as sc
from sac_compile._compat import aot as aot_compat
from sac_compile.compiler import session

from .releases import extended

INNER = "aot_eager"


class Attn(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x):
        return self.o(torch.tanh(self.q(x)))


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a = nn.Linear(d, 4 * d)
        self.b = nn.Linear(4 * d, d)

    def forward(self, x):
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()  # inside the declared region "mlp"
        return self.b(h)


class Layer(nn.Module):
    """Graph breaks between regions (after attn) and inside a declared region (mlp); a decorated
    region (gate) after them (a break inside a decorated function: tests/test_markers.py)."""

    def __init__(self, d):
        super().__init__()
        self.attn = Attn(d)
        self.mlp = MLP(d)
        self.g = nn.Linear(d, d)

    def forward(self, x):
        x = x + self.attn(x)
        torch._dynamo.graph_break()
        x = x + self.mlp(x)
        return self.gated(x)

    @sc.region("gate")
    def gated(self, x):
        return x * torch.sigmoid(self.g(x))


REGIONS = {"layer.attn": "attn", "layer.mlp": "mlp"}


class Net(nn.Module):
    """Code before the layer (in its first graph), the layer, a break, the loss-like tail."""

    def __init__(self, d=16):
        super().__init__()
        self.pre = nn.Linear(d, d)
        self.layer = Layer(d)

    def forward(self, x):
        h = self.layer(torch.relu(self.pre(x)))
        torch._dynamo.graph_break()
        return torch.log_softmax(h, -1)


def _net():
    torch.manual_seed(0)
    net = Net()
    sc.declare_regions(net, REGIONS)
    return net


def _rows(report, graphs=None):
    """Saved activations per (region, op, shape), over the report's training graphs."""
    rows = Counter()
    for g in report.graphs:
        if g.record is None or not g.record.is_training or (graphs is not None and not graphs(g)):
            continue
        rows.update((v.region, v.op, v.shape) for v in g.saved if not v.is_input)
    return rows


def _in_a_scope(g) -> bool:
    return bool(g.record.scopes)


KEEP_SETS = [frozenset(), frozenset({"attn"}), frozenset({"mlp", "gate"})]


@pytest.mark.slow
@pytest.mark.parametrize("keep", KEEP_SETS, ids=lambda k: "+".join(sorted(k)) or "none")
def test_a_graph_broken_layer_saves_what_it_saves_compiled_on_its_own(keep):
    """Whole-model compile with ``sac_backend`` and with a backend keeping nothing. Red before:
    every piece after the first break was a "whole graph" scope with the *backend's* keep set
    (ALL_REGIONS: attn kept under keep=(); nothing: attn recomputed under keep={"attn"}), and
    regions open across a break were lost."""
    x = torch.randn(4, 8, 16, requires_grad=True)
    alone = _net()  # the same layer, unwrapped, compiled on its own with the keep set
    layer_input = torch.relu(alone.pre(x))
    want = _rows(
        sc.inspection.capture_partition(
            alone.layer, layer_input, backend=sc.make_sac_backend(keep, inner=INNER)
        )
    )
    for model_keep in ((),):  # the backend's keep set differs from the layers' (red before)
        net = _net()
        sc.apply_selective_checkpointing(net.layer, keep)
        # the whole model compiled with the backend (capture_partition compiles fn itself)
        whole = sc.inspection.capture_partition(net, x, backend=sc.make_sac_backend(model_keep, inner=INNER))
        assert _rows(whole, _in_a_scope) == want, (model_keep, whole)
        # every piece of the layer carries the layer's scope and keep set
        layer_graphs = [g for g in whole.graphs if g.record and g.record.is_training and g.record.scopes]
        assert len(layer_graphs) >= 3  # attn | mlp (2 pieces) | residual + gate
        for g in layer_graphs:
            (scope,) = g.record.scopes
            assert scope.keep == keep, (g.index, scope)
        kept = {r.name for g in layer_graphs for r in g.record.regions.values() if r.kept}
        assert kept == set(keep)
        # the regions split by a break are open in the pieces after it
        starts = Counter(name for g in layer_graphs for name in g.record.starts_inside)
        assert starts["mlp"] >= 1, starts


@pytest.mark.slow
@pytest.mark.parametrize("keep", [KEEP_SETS[0], KEEP_SETS[2]], ids=["none", "gate+mlp"])
def test_saved_bytes_match_the_per_layer_compile(keep):
    """Activation bytes autograd holds: whole-model compile (sac_backend) == the layer compiled
    on its own with its keep set, the rest of the model eager (red before: keep=() saved
    attn's matmuls under sac_backend's ALL_REGIONS)."""
    x = torch.randn(4, 8, 16, requires_grad=True)
    torch._dynamo.reset()
    net = _net()
    sc.apply_selective_checkpointing(net.layer, keep)
    compiled = torch.compile(net, backend=sc.make_sac_backend(sc.ALL_REGIONS, inner=INNER))
    got = sc.inspection.autograd_saved_bytes(compiled, x, exclude=list(net.parameters()))
    torch._dynamo.reset()
    ref = _net()
    ref.layer = torch.compile(ref.layer, backend=sc.make_sac_backend(keep, inner=INNER))
    want = sc.inspection.autograd_saved_bytes(ref, x, exclude=list(ref.parameters()))
    assert got == want, (sorted(keep), got, want)


def _record_joint_tags(monkeypatch) -> list:
    """(record, names of nodes with a recompute tag, node name -> op) of every joint graph the
    aot_eager backends hand to the min-cut partitioner from now on."""
    joints = []
    min_cut = aot_compat.min_cut_rematerialization_partition

    def partition(joint, joint_inputs, **kwargs):
        unit = session.current_unit()
        rec = unit.records[-1] if unit and unit.records else None
        tagged = {n.name for n in joint.graph.nodes if "recompute" in n.meta}
        ops = {n.name: str(n.target) for n in joint.graph.nodes if n.op == "call_function"}
        joints.append((rec, tagged, ops))
        return min_cut(joint, joint_inputs, **kwargs)

    monkeypatch.setattr(aot_compat, "min_cut_rematerialization_partition", partition)
    return joints


def test_no_node_outside_a_scope_carries_a_recompute_tag(monkeypatch):
    """Asserted on the joint graphs the partitioner receives. Red before: ``pre`` (its graph
    ends where the layer's call broke it) and the tail after the break (log_softmax) were each a
    "whole graph" scope, every node MUST_RECOMPUTE."""
    joints = _record_joint_tags(monkeypatch)
    torch._dynamo.reset()
    net = _net()
    sc.apply_selective_checkpointing(net.layer, {"attn"})
    torch.compile(net, backend=sc.make_sac_backend(sc.ALL_REGIONS, inner=INNER))(
        torch.randn(4, 8, 16, requires_grad=True)
    ).sum().backward()

    assert len(joints) >= 6
    unscoped = []
    for rec, tagged, ops in joints:
        if rec is None:  # a graph holding no marker: compiled untouched (no pass, no record)
            assert not tagged, sorted(tagged)
            unscoped.append(" ".join(ops.values()))
            continue
        outside = tagged - set(rec.node_scope)
        assert not outside, sorted(outside)  # a tagged node is always in one of the graph's scopes
        if not rec.scopes:
            assert rec.outside_every_scope and not tagged, sorted(tagged)
            unscoped.append(" ".join(ops.values()))
    # `pre` (before the layer's call, which broke the graph) and the tail after the break
    assert len(unscoped) == 2 and any("_log_softmax" in ops for ops in unscoped), unscoped


# --- transformers models, whole-model compile -----------------------------------------------


def _mixtral():
    """One Mixtral layer with eager experts: ``nonzero`` in the expert loop breaks the graph."""
    transformers = pytest.importorskip("transformers")
    from sac_compile.testing import hf_families

    cfg = transformers.MixtralConfig(
        **{**hf_families._TINY, "num_hidden_layers": 1, "hidden_size": 32},
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM._from_config(
        cfg, attn_implementation="sdpa", experts_implementation="eager"
    )
    return model.train()


MIXTRAL_REGIONS = {
    "model.layers.*.self_attn": "attn",
    "model.layers.*.mlp.gate": "router",
    "model.layers.*.mlp.experts": "experts",
}


@pytest.mark.slow
@extended  # CI: the synthetic layer above checks the same fix; this is Mixtral's own layer
@pytest.mark.parametrize("model_keep", [(), sc.ALL_REGIONS], ids=["none", "all"])
def test_mixtral_eager_experts_keeps_each_layers_keep_set(model_keep):
    """keep={"attn"} under a backend keeping nothing and under one keeping every region (the
    synthetic layer above covers three keep sets). Red before: the pieces after the router's
    break were "whole graph" scopes with the backend's keep set, so attention was recomputed
    under the former."""
    from sac_compile import hf

    keep = frozenset({"attn"})
    ids = hf.batch(_mixtral(), batch=2, seq=8)
    alone = _mixtral()
    sc.declare_regions(alone, MIXTRAL_REGIONS)
    unit, h = hf.layer_call(alone, ids)
    backend = sc.make_sac_backend(keep, inner=INNER)
    want = _rows(sc.inspection.capture_partition(unit, h.detach().requires_grad_(), backend=backend))
    # the expert loop itself runs eagerly (Dynamo skips a frame whose loop breaks the graph),
    # so in compiled code attention is what has matmuls to keep
    assert "attn" in {region for region, _, _ in want}, want
    model = _mixtral()
    sc.SacConfig(layers="model.layers.*", keep=keep, regions=MIXTRAL_REGIONS).apply(model)
    backend = sc.make_sac_backend(model_keep, inner=INNER)
    report = sc.inspection.capture_partition(model, ids, labels=ids, use_cache=False, backend=backend)
    assert _rows(report, _in_a_scope) == want, (model_keep, report)
    for g in report.graphs:
        if g.record is not None and g.record.is_training:
            assert [s.keep for s in g.record.scopes] in ([keep], []), (g.index, g.record.scopes)


@pytest.mark.slow
def test_gpt2_whole_model_compile_leaves_the_loss_untagged(monkeypatch):
    """transformers' ``warning_once`` breaks the graph before the loss: the loss graph holds no
    scope (red before: one "whole graph" scope, ``_log_softmax`` and all MUST_RECOMPUTE)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        vocab_size=128, n_positions=64, n_embd=32, n_layer=1, n_head=4, eos_token_id=0, bos_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa").train()
    regions = {"transformer.h.*.attn": "attn", "transformer.h.*.mlp": "mlp"}
    sc.SacConfig(layers="transformer.h.*", keep={"attn"}, regions=regions).apply(model)
    joints = _record_joint_tags(monkeypatch)
    ids = torch.randint(0, 128, (2, 8))
    backend = sc.make_sac_backend(sc.ALL_REGIONS, inner=INNER)
    report = sc.inspection.capture_partition(model, ids, labels=ids, use_cache=False, backend=backend)
    for rec, tagged, _ in joints:
        if rec is None:  # a graph holding no marker: compiled untouched
            assert not tagged, sorted(tagged)
            continue
        assert not tagged - set(rec.node_scope), sorted(tagged - set(rec.node_scope))
        if not rec.scopes:
            assert rec.outside_every_scope and not tagged, sorted(tagged)
    # the loss graph, after the break, untagged
    loss_graphs = [" ".join(ops.values()) for rec, _, ops in joints if rec is None or not rec.scopes]
    assert any("_log_softmax" in ops for ops in loss_graphs), loss_graphs
    assert "not checkpointed" in str(report), report


def test_a_declared_region_split_by_a_break_is_reported_once_at_its_module(caplog):
    """One ``graph-break`` report naming the declared module and its path (red before: one per
    piece, each naming whatever module that piece's frame belonged to, without a path)."""
    import logging

    net = _net()
    sc.apply_selective_checkpointing(net.layer, {"attn"})
    compiled = torch.compile(net, backend=sc.make_sac_backend(sc.ALL_REGIONS, inner=INNER))
    with caplog.at_level(logging.WARNING, logger="sac_compile"):
        for _ in range(2):
            compiled(torch.randn(4, 8, 16, requires_grad=True)).sum().backward()
    msgs = [r.getMessage() for r in caplog.records if "[graph-break] region 'mlp'" in r.getMessage()]
    assert len(msgs) == 1 and "in MLP (layer.mlp)" in msgs[0], msgs
    assert not [r.getMessage() for r in caplog.records if "[unbalanced]" in r.getMessage()]


class _Gate(nn.Module):
    """A router whose forward graph-breaks (``.tolist()``, as transformers 4.x MoE routers did)."""

    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, 2)

    def forward(self, x):
        logits = self.proj(x)
        sizes = (logits > 0).sum().tolist()  # a graph break: Dynamo compiles this frame on its own
        return torch.softmax(logits, -1) * (1 + sizes * 0)


class _AttnWithGate(nn.Module):  # JetMoE's attention: a gate of the same class inside it
    def __init__(self, d):
        super().__init__()
        self.gate, self.o = _Gate(d), nn.Linear(2, d)

    def forward(self, x):
        return self.o(self.gate(x))


class _GatedLayer(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.attn, self.router, self.out = _AttnWithGate(d), _Gate(d), nn.Linear(2, d)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.out(self.router(x))


def test_a_graph_compiled_in_one_region_and_run_in_another_is_reported(caplog):
    """The gate inside attn and the router are one class whose forward graph-breaks: Dynamo
    compiles that forward once (inside 'attn') and reuses it for the router, whose ops are then
    tagged as in 'attn' (not kept). Red before: nothing said so but a keep-unused for 'router'."""
    import logging

    torch._dynamo.reset()
    model = nn.Sequential(_GatedLayer())
    sc.SacConfig(
        layers="0",
        keep={"router"},
        regions={"0.attn": "attn", "0.router": "router"},
        compile={"inner": INNER},
    ).apply(model)
    with caplog.at_level(logging.WARNING, logger="sac_compile"):
        for _ in range(2):
            model(torch.randn(4, 16, requires_grad=True)).sum().backward()
    msgs = [r.getMessage() for r in caplog.records if "[graph-reused]" in r.getMessage()]
    assert msgs and all("in _Gate:" in m for m in msgs), [r.getMessage() for r in caplog.records]
    assert any("compiled inside regions 'attn' but runs inside regions 'router'" in m for m in msgs), msgs
