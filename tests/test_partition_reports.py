"""Expect tests of `capture_partition(...).format()`, each paired with a gradient check.

Every scenario is pinned with ``inner="aot_eager"``; Inductor decomposes differently
before partitioning (node names and recomputed ops differ), so one scenario is pinned
with Inductor and one more must agree with aot_eager region by region.

What is pinned holds on every supported PyTorch release: scopes, regions, every saved
value (op, region, shape, bytes) and the *costly* ops each region recomputes. The cheap
recomputed ops are left out: how a release decomposes them is not ours (2.14:
``Dropout(0.0)`` in training traces to nothing instead of a ``clone``; 2.15: a 3-D
``Linear`` output's reshape is ``_unsafe_view`` instead of ``view``).
"""

import re

import pytest
import torch
from expecttest import TestCase

import sac_compile as sc

from .releases import every_release
from .scenarios import cases

_COSTLY = re.compile(r"(mm|addmm|bmm|baddbmm|convolution|\w*scaled_dot_product\w*|\w*attention\w*)")
_RECOMPUTED = re.compile(r"^  (\S+): \d+ ops: (.*)$")


def _pinned(text: str) -> str:
    """``format()`` with each region's recomputed ops reduced to its costly ones."""
    lines = []
    for line in text.splitlines():
        m = _RECOMPUTED.match(line)
        if m:
            costly = [op for op in m.group(2).split(", ") if _COSTLY.fullmatch(op.split(" x")[0])]
            line = f"  {m.group(1)}: {', '.join(costly) if costly else 'no costly op'}"
        lines.append(re.sub(r"; \d+ ops recomputed$", "", line))
    return "\n".join(lines)


def _report(name: str, inner: str) -> str:
    make, inp, keep = cases()[name]
    torch.manual_seed(0)
    module, x = make(), inp().requires_grad_()
    return _pinned(
        sc.inspection.capture_partition(module, x, backend=sc.make_sac_backend(keep, inner=inner)).format()
    )


def test_the_pinned_form_keeps_costly_ops_only():
    text = "recomputed:\n  -: 4 ops: clone, mm x2, t\n  mlp: 2 ops: relu, t\ntotal: 1 activations, 128 B; 6 ops recomputed"
    assert _pinned(text) == "recomputed:\n  -: mm x2\n  mlp: no costly op\ntotal: 1 activations, 128 B"


def _summary(name: str, inner: str) -> tuple:
    """What a report says independently of decompositions: each graph's header (scopes, kept
    and recomputed regions), the activation bytes saved per region, the regions recomputed."""
    make, inp, keep = cases()[name]
    torch.manual_seed(0)
    module, x = make(), inp().requires_grad_()
    report = sc.inspection.capture_partition(module, x, backend=sc.make_sac_backend(keep, inner=inner))
    headers = tuple(line for line in report.format().splitlines() if line.startswith("graph "))
    by_region = {k: v for k, v in report.bytes_by_region().items() if v}
    recomputed = sorted({r for g in report.graphs for r in g.recomputed})
    return headers, by_region, recomputed


def _check_grads(name: str, inner: str) -> None:
    """Compiled SAC equals the uncompiled, un-checkpointed module in float64."""
    make, inp, keep = cases()[name]
    torch.manual_seed(0)
    module = make().double()
    x = inp().double().requires_grad_()
    ref_out = module(x)
    ref = torch.autograd.grad(ref_out.sum(), [x, *module.parameters()])
    torch._dynamo.reset()
    compiled = torch.compile(module, backend=sc.make_sac_backend(keep, inner=inner))
    out = compiled(x)
    got = torch.autograd.grad(out.sum(), [x, *module.parameters()])
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-12)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12)


class TestAotEager(TestCase):
    inner = "aot_eager"

    def test_mlp_kept(self):
        self.assertExpectedInline(
            _report("mlp_kept", self.inner),
            """\
graph 0: scopes [#1 whole graph keep=mlp] regions [mlp(kept)]
saved    op          region  scope  shape   dtype    bytes
addmm_1  aten.addmm  mlp     #1     [4, 8]  float32  128
inputs saved: 1 (128 B); parameters saved: 3 (2176 B)
recomputed:
  -: addmm
  mlp: no costly op
total: 1 activations, 128 B""",
        )
        _check_grads("mlp_kept", self.inner)

    def test_attn_kept_mlp_recomputed(self):
        self.assertExpectedInline(
            _report("attn_kept_mlp_recomputed", self.inner),
            """\
graph 0: scopes [#1 whole graph keep=attn] regions [attn(kept), mlp(recomputed)]
saved      op       region  scope  shape         dtype    bytes
getitem_3  getitem  attn    #1     [2, 2, 4, 8]  float32  512
getitem_4  getitem  attn    #1     [2, 2, 4]     float32  64
inputs saved: 1 (512 B); parameters saved: 9 (12800 B)
recomputed:
  -: mm x2
  attn: no costly op
  mlp: addmm
total: 2 activations, 576 B""",
        )
        _check_grads("attn_kept_mlp_recomputed", self.inner)

    def test_two_regions_one_kept(self):
        self.assertExpectedInline(
            _report("two_regions_one_kept", self.inner),
            """\
graph 0: scopes [#1 whole graph keep=a] regions [a(kept), b(recomputed)]
saved  op       region  scope  shape   dtype    bytes
mm     aten.mm  a       #1     [4, 8]  float32  128
inputs saved: 1 (128 B); parameters saved: 2 (512 B)
recomputed:
  a: no costly op
  b: mm
total: 1 activations, 128 B""",
        )
        _check_grads("two_regions_one_kept", self.inner)

    def test_nested_overlap(self):
        self.assertExpectedInline(
            _report("nested_overlap_keep_inner_x", self.inner),
            """\
graph 0: scopes [#1 whole graph keep=inner+x] regions [inner(kept), outer(recomputed), x(kept)]
saved  op       region       scope  shape   dtype    bytes
mm_1   aten.mm  inner+outer  #1     [4, 8]  float32  128
mm_2   aten.mm  outer+x      #1     [4, 8]  float32  128
mm_3   aten.mm  x            #1     [4, 8]  float32  128
inputs saved: 1 (128 B); parameters saved: 1 (256 B)
recomputed:
  -: mm
  inner+outer: no costly op
  outer: mm
  outer+x: no costly op
  x: no costly op
total: 3 activations, 384 B""",
        )
        _check_grads("nested_overlap_keep_inner_x", self.inner)

    def test_unbalanced(self):
        self.assertExpectedInline(
            _report("unbalanced", self.inner),
            """\
graph 0: scopes [#1 whole graph keep=early+late] regions [early(kept), late(kept)]; unbalanced: early exit without enter, late enter without exit
saved  op       region  scope  shape   dtype    bytes
mm     aten.mm  early   #1     [4, 8]  float32  128
mm_2   aten.mm  late    #1     [4, 8]  float32  128
inputs saved: 1 (128 B); parameters saved: 1 (256 B)
recomputed:
  -: mm
  early: no costly op
  late: no costly op
total: 2 activations, 256 B""",
        )
        _check_grads("unbalanced", self.inner)

    def test_in_checkpoint(self):
        self.assertExpectedInline(
            _report("in_checkpoint", self.inner),
            """\
graph 0: scopes [#1 torch.utils.checkpoint keep=core] regions [core(kept)]; overrides checkpoint policy: core in #1
saved  op         region  scope  shape   dtype    bytes
relu   aten.relu  -       -      [4, 8]  float32  128
mm_2   aten.mm    core    #1     [4, 8]  float32  128
mm_4   aten.mm    -       -      [4, 8]  float32  128
inputs saved: 1 (128 B); parameters saved: 1 (256 B)
recomputed:
  -: mm x2
  core: no costly op
total: 3 activations, 384 B""",
        )
        _check_grads("in_checkpoint", self.inner)

    @pytest.mark.slow
    def test_scoped_stack(self):
        self.assertExpectedInline(
            _report("scoped_stack", self.inner),
            """\
graph 0: scopes [#1 scope markers keep=attn, #2 scope markers keep=attn, #3 scope markers keep=attn, #4 scope markers keep=attn] regions [attn(kept), mlp(recomputed)]
saved       op        region  scope  shape         dtype    bytes
getitem_3   getitem   attn    #1     [2, 2, 4, 8]  float32  512
getitem_4   getitem   attn    #1     [2, 2, 4]     float32  64
add_1       aten.add  -       #1     [2, 4, 16]    float32  512
getitem_11  getitem   attn    #2     [2, 2, 4, 8]  float32  512
getitem_12  getitem   attn    #2     [2, 2, 4]     float32  64
add_3       aten.add  -       #2     [2, 4, 16]    float32  512
getitem_19  getitem   attn    #3     [2, 2, 4, 8]  float32  512
getitem_20  getitem   attn    #3     [2, 2, 4]     float32  64
add_5       aten.add  -       #3     [2, 4, 16]    float32  512
getitem_27  getitem   attn    #4     [2, 2, 4, 8]  float32  512
getitem_28  getitem   attn    #4     [2, 2, 4]     float32  64
inputs saved: 1 (512 B); parameters saved: 36 (51200 B)
recomputed:
  -: mm x8
  attn: no costly op
  mlp: addmm x4
total: 11 activations, 3840 B""",
        )
        _check_grads("scoped_stack", self.inner)


class TestInductor(TestCase):
    """Inductor decomposes before partitioning, so node names and the recomputed ops differ
    from aot_eager's; one scenario is pinned (with its gradients), and one more (nested,
    overlapping regions: where node-level differences could shift a value between regions)
    must agree with aot_eager on what matters: the scopes, the regions kept and recomputed,
    and the bytes each region saves."""

    inner = "inductor"

    @pytest.mark.slow
    @every_release
    def test_attn_kept_mlp_recomputed(self):
        self.assertExpectedInline(
            _report("attn_kept_mlp_recomputed", self.inner),
            """\
graph 0: scopes [#1 whole graph keep=attn] regions [attn(kept), mlp(recomputed)]
saved      op       region  scope  shape         dtype    bytes
getitem_2  getitem  attn    #1     [2, 2, 4, 8]  float32  512
getitem_3  getitem  attn    #1     [2, 2, 4]     float32  64
inputs saved: 1 (512 B); parameters saved: 9 (12800 B)
recomputed:
  -: mm x2
  attn: no costly op
  mlp: addmm
total: 2 activations, 576 B""",
        )
        _check_grads("attn_kept_mlp_recomputed", self.inner)

    @pytest.mark.slow
    def test_regions_and_saved_bytes_match_aot_eager(self):
        for name in ("nested_overlap_keep_inner_x",):
            got, want = _summary(name, "inductor"), _summary(name, "aot_eager")
            assert got == want, (name, got, want)
