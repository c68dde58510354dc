"""FlashAttention kernels (flash_torch, flash_triton) against a float64 reference.

CPU: the Triton kernels run under the interpreter, which must be switched on before
triton is imported:  TRITON_INTERPRET=1 python -m pytest tests/test_flash_attention.py
(the setdefault below does it when this file is the first to import triton). On a GPU the
same tests run compiled; the `gpu` marker tags the ones that need CUDA.
"""
from __future__ import annotations

import itertools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from core.errors import ConfigError  # noqa: E402
from core.kernels import flash_triton as ft  # noqa: E402
from core.kernels._flash_common import reference_attention  # noqa: E402
from core.kernels.flash_torch import FlashAttentionTorch  # noqa: E402
from core.kernels.flash_triton import FlashAttentionTriton, FlashConfig, flash_attention_with_lse  # noqa: E402
from core.kernels.flash_triton import common as ftc, dispatch as ftd, launch as ftl  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _triton_usable() -> bool:
    """CUDA, or an interpreter that really is on (TRITON_INTERPRET must precede `import triton`)."""
    if not ft.HAVE_TRITON:
        return False
    if CUDA:
        return True
    if not ftc.INTERPRET:
        return False
    try:
        x = torch.randn(1, 1, 4, 16)
        flash_attention_with_lse(x, x, x, True)
        return True
    except Exception:  # triton imported before TRITON_INTERPRET was set: interpreter half-on
        return False


TRITON_OK = _triton_usable()
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="needs CUDA, or TRITON_INTERPRET=1 set before triton "
                                  "is first imported (tests/conftest.py)")
gpu = pytest.mark.gpu

# relative-error bounds by dtype (fp32 dots run as TF32 in the Triton kernel on the GPU)
TOL = {torch.float32: 5e-3 if CUDA else 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# absolute bound between two Triton backward variants / tilings on the same fp32 inputs
SAME_TOL = 1e-3 if CUDA else 1e-5


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(a).any(), "NaN in result (unwritten or invalid element)"
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-6)).item()


def make_qkv(shape_q, n_k, dtype, noncontig=False):
    *lead, n_q, d = shape_q
    if noncontig and len(lead) == 2:  # (B, T, H, D) transposed to (B, H, T, D), as in the model
        b, h = lead
        q = torch.randn(b, n_q, h, d, device=DEVICE, dtype=dtype).transpose(1, 2)
        k = torch.randn(b, n_k, h, d, device=DEVICE, dtype=dtype).transpose(1, 2)
        v = torch.randn(b, n_k, h, d, device=DEVICE, dtype=dtype).transpose(1, 2)
    else:
        q = torch.randn(*lead, n_q, d, device=DEVICE, dtype=dtype)
        k = torch.randn(*lead, n_k, d, device=DEVICE, dtype=dtype)
        v = torch.randn(*lead, n_k, d, device=DEVICE, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v)]


def check_against_reference(fn, q, k, v, causal, tol):
    out = fn(q, k, v, causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    do = torch.randn_like(out)
    out.backward(do)
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, _ = reference_attention(qr, kr, vr, causal)
    ref.backward(do.double())
    assert rel_err(out, ref) < tol
    for g, gr, name in ((q.grad, qr.grad, "dq"), (k.grad, kr.grad, "dk"), (v.grad, vr.grad, "dv")):
        assert g.dtype == q.dtype and g.shape == gr.shape, name
        if gr.norm() > 1e-3:
            assert rel_err(g, gr) < tol, name
        else:  # e.g. a single key: softmax is constant, dq = dk = 0
            assert (g.double() - gr).abs().max() < 1e-2, name


def triton_with(cfg: FlashConfig):
    """FlashAttentionTriton.apply with a config: fn(q, k, v, is_causal)."""
    def fn(q, k, v, is_causal):
        return FlashAttentionTriton.apply(q, k, v, is_causal, cfg)
    return fn


TWO_PASS, ATOMIC_DQ, FUSED = (FlashConfig(backward=b) for b in ("two_pass", "atomic_dq", "fused"))
# flash_triton with the default config ("auto": the fused backward at these small grids) and the other two backward
# variants pinned
IMPLS = [pytest.param(FlashAttentionTorch.apply, id="flash_torch"),
         pytest.param(FlashAttentionTriton.apply, id="flash_triton", marks=needs_triton),
         pytest.param(triton_with(TWO_PASS), id="flash_triton_two_pass", marks=needs_triton),
         pytest.param(triton_with(ATOMIC_DQ), id="flash_triton_atomic_dq", marks=needs_triton)]
# each Triton backward variant, for the tests that take a config
BWD_CONFIGS = pytest.mark.parametrize("cfg", [TWO_PASS, ATOMIC_DQ, FUSED], ids=["two_pass", "atomic_dq", "fused"])

# (q shape, n_k, causal): odd lengths, N_q != N_k both ways (causal bottom-right), extra lead dims
CASES = [((2, 2, 37, 16), 37, True), ((1, 2, 33, 32), 70, True), ((1, 2, 70, 16), 33, True),
         ((2, 1, 50, 16), 45, False), ((1, 1, 1, 16), 1, True), ((3, 40, 16), 40, True),
         ((2, 1, 2, 24, 16), 24, True)]


@pytest.mark.parametrize("fn", IMPLS)
@pytest.mark.parametrize("shape_q,n_k,causal", CASES)
def test_matches_float64_fp32(fn, shape_q, n_k, causal):
    torch.manual_seed(hash((shape_q, n_k, causal)) % 2**31)
    q, k, v = make_qkv(shape_q, n_k, torch.float32)
    check_against_reference(fn, q, k, v, causal, TOL[torch.float32])


@pytest.mark.parametrize("fn", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [16, 32, 64, 80, 96, 128])
def test_dtypes_and_head_dims(fn, dtype, d):
    torch.manual_seed(d)
    q, k, v = make_qkv((1, 2, 40, d), 40, dtype)
    check_against_reference(fn, q, k, v, True, TOL[dtype])


@pytest.mark.parametrize("fn", IMPLS)
@pytest.mark.parametrize("d", [8, 24, 48, 80, 100, 160, 256])
def test_head_dims_padded_to_the_tile(fn, d):
    """Head dims that are not a power of two (80: the CS336 xl and 2.7B models; 100, 160) and the ends of the range
    (8 under tl.dot's 16, 256): padded to a power-of-two tile with masked columns, against float64, with N_q != N_k
    and a ragged last tile."""
    torch.manual_seed(d)
    q, k, v = make_qkv((1, 2, 37, d), 45, torch.float32)
    check_against_reference(fn, q, k, v, True, TOL[torch.float32])


@pytest.mark.parametrize("fn", IMPLS)
def test_non_contiguous_model_layout(fn):
    torch.manual_seed(1)
    q, k, v = make_qkv((2, 3, 41, 32), 41, torch.float32, noncontig=True)
    assert not q.is_contiguous()
    check_against_reference(fn, q, k, v, True, TOL[torch.float32])


def fused_qkv_views(b, t, h, h_kv, d, dtype, views):
    """q, k, v as core/model.py makes them: one (B, T, H + 2 H_kv, d) projection, transposed to heads-first and
    split, so each is a view with gaps between its heads' rows. views[i] False hands over a dense copy instead."""
    qkv = torch.randn(b, t, h + 2 * h_kv, d, device=DEVICE, dtype=dtype)
    parts = qkv.transpose(1, 2).split([h, h_kv, h_kv], dim=1)
    return [(x if view else x.contiguous()).detach().requires_grad_() for x, view in zip(parts, views)]


VIEW_COMBOS = [(q, k, v) for q in (False, True) for k in (False, True) for v in (False, True)]


def check_gqa_against_reference(cfg, b, h, kv_heads, n_q, n_k, d, dtype, causal):
    """flash_triton on k, v with kv_heads heads (q has h) as they are, against float64 attention over k, v repeated
    per query head, whose autograd sums dK, dV over each group."""
    q = torch.randn(b, h, n_q, d, device=DEVICE, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, kv_heads, n_k, d, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(2))
    out = FlashAttentionTriton.apply(q, k, v, causal, cfg)
    do = torch.randn_like(out)
    out.backward(do)
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, _ = reference_attention(qr, kr.repeat_interleave(h // kv_heads, dim=1),
                                 vr.repeat_interleave(h // kv_heads, dim=1), causal)
    ref.backward(do.double())
    assert rel_err(out, ref) < TOL[dtype]
    for g, gr, x in ((q.grad, qr.grad, q), (k.grad, kr.grad, k), (v.grad, vr.grad, v)):
        assert g.shape == x.shape and g.dtype == dtype and rel_err(g, gr) < TOL[dtype]


@needs_triton
@BWD_CONFIGS
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_query_attention_natively(cfg, kv_heads):
    """4 query heads on 1 or 2 KV heads, k and v passed with their own heads (no copies): every backward variant,
    causal and not, N_q != N_k, d = 80 (a 64-column part and a tail)."""
    torch.manual_seed(kv_heads)
    for causal in (True, False):
        check_gqa_against_reference(cfg, 2, 4, kv_heads, 37, 45, 80, torch.float32, causal)


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("cfg", [TWO_PASS, FlashConfig(backward="atomic_dq", ws_min_rows=0), FUSED],
                         ids=["two_pass", "atomic_dq_ws", "fused"])
@pytest.mark.parametrize("d", [64, 80, 96, 128])
def test_gpu_grouped_query_attention_natively(cfg, d):
    """GQA on the compiled kernels (the Gluon backward where it applies: bf16, each head dim it takes, 80 and 96
    with their tails), causal and not."""
    torch.manual_seed(3)
    for causal in (True, False):
        check_gqa_against_reference(cfg, 2, 8, 2, 1024, 1024, d, torch.bfloat16, causal)


@needs_triton
def test_outputs_of_fused_projection_views_are_dense_in_the_model_order():
    """q, k, v sliced from the fused projection are read in place (no copies); O and the gradients are dense in the
    same (B, T, H, d) order, so the model's transpose back to (B, T, H * d) is a view, as with SDPA."""
    torch.manual_seed(5)
    q, k, v = fused_qkv_views(2, 37, 2, 2, 16, torch.float32, (True, True, True))
    out = FlashAttentionTriton.apply(q, k, v, True)
    assert out.transpose(1, 2).is_contiguous()
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all(g.transpose(1, 2).is_contiguous() for g in grads)


def test_dense_like_keeps_the_layout_rule_per_operand_layout(monkeypatch):
    """`_dense_like` computes an operand layout's output strides once (then `empty_strided`): for a dense tensor, a
    transposed one, fused-projection views, an expanded GQA key (stride 0) and size-1 dims, its first and its later
    outputs are laid out as the rule (`_dense_layout`) lays them out, each in new storage."""
    monkeypatch.setattr(ftd, "_DENSE_STRIDES", {})
    base = torch.randn(2, 37, 8, 16)
    operands = [torch.randn(2, 4, 37, 16), base.transpose(1, 2), *base.transpose(1, 2).split([4, 2, 2], dim=1),
                torch.randn(2, 1, 37, 16).expand(2, 4, 37, 16), torch.randn(1, 4, 1, 16)[:, :, :1],
                torch.randn(2, 37, 1, 16).transpose(1, 2)]
    for x in operands:
        want = ftd._dense_layout(x).stride()
        outs = [ftd._dense_like(x) for _ in range(3)]
        assert all(o.shape == x.shape and o.stride() == want and o.dtype == x.dtype for o in outs)
        assert len({o.data_ptr() for o in outs}) == 3
    assert len(ftd._DENSE_STRIDES) == len(operands) - 1  # the k and v views have one layout


@needs_triton
def test_tma_desc_reuses_a_geometry_fields_and_checks_alignment(monkeypatch):
    """A TMA descriptor over a tensor of a geometry seen before is the validated one's fields over the new tensor;
    a base off 16-byte alignment is still refused."""
    from core.kernels.flash_triton import hopper
    if not hopper.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(hopper, "_DESC_FIELDS", {})
    a, b = (torch.zeros(2, 3, 128, 64, dtype=torch.bfloat16) for _ in range(2))
    first, second = hopper.tma_desc(a, (1, 1, 64, 64)), hopper.tma_desc(b, (1, 1, 64, 64))
    fresh = hopper.TensorDescriptor(b, list(b.shape), list(b.stride()), [1, 1, 64, 64], first.layout)
    assert first.base is a and second.base is b and type(second) is type(fresh)
    assert {n: getattr(second, n) for n in vars(fresh)} == {n: getattr(fresh, n) for n in vars(fresh)}
    flat = torch.zeros(2 * 3 * 128 * 64 + 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        hopper.tma_desc(torch.as_strided(flat, a.shape, a.stride(), 4), (1, 1, 64, 64))


@pytest.mark.parametrize("fn", IMPLS)
@pytest.mark.parametrize("views", VIEW_COMBOS, ids=lambda c: "views_" + ("".join(n for n, on in zip("qkv", c) if on)
                                                                         or "none"))
def test_fused_projection_views(fn, views):
    """Every combination of q, k, v as non-dense views of the fused qkv projection, causal and not: outputs and
    gradients against float64 (outputs and gradients were written with the dense copies' strides into tensors
    laid out like the views, scrambling them)."""
    torch.manual_seed(sum(views))
    q, k, v = fused_qkv_views(2, 37, 2, 2, 16, torch.float32, views)
    assert q.is_contiguous() != views[0] and k.is_contiguous() != views[1] and v.is_contiguous() != views[2]
    for causal in (True, False):
        for x in (q, k, v):
            x.grad = None
        check_against_reference(fn, q, k, v, causal, TOL[torch.float32])


@pytest.mark.parametrize("fn", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_fused_projection_views_half(fn, dtype):
    torch.manual_seed(5)
    q, k, v = fused_qkv_views(1, 70, 2, 2, 32, dtype, (True, True, True))
    check_against_reference(fn, q, k, v, True, TOL[dtype])


@pytest.mark.parametrize("impl", ["flash_torch", "flash_triton"])
def test_grouped_query_views_through_the_plugin(impl):
    """Grouped-query attention as the model runs it: q a view of the fused projection, k and v (2 KV heads for 4
    query heads) expanded by the attention plugin; gradients flow back to the unexpanded k and v."""
    if impl == "flash_triton" and not TRITON_OK:
        pytest.skip("needs CUDA or the Triton interpreter")
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from tests.utils import CONF
    attn = instantiate(OmegaConf.load(CONF / "attention_impl" / f"{impl}.yaml"))
    torch.manual_seed(6)
    q, k, v = fused_qkv_views(2, 33, 4, 2, 16, torch.float32, (True, True, True))
    out = attn(q, k, v, is_causal=True)
    do = torch.randn_like(out)
    out.backward(do)
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, _ = reference_attention(qr, kr.repeat_interleave(2, dim=1), vr.repeat_interleave(2, dim=1), True)
    ref.backward(do.double())
    assert rel_err(out, ref) < TOL[torch.float32]
    for g, gr in ((q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)):
        assert g.shape == gr.shape and rel_err(g, gr) < TOL[torch.float32]


# Fused backward: program i does key tile i (BLOCK_N wide) and query tile i (BLOCK_M high); with several
# tiles both ways and unequal tile counts, some programs skip one phase. Pinned tiles: equal, and unequal
# both ways (the interpreter's default for the fused kernel is 32/16). Outputs poisoned with NaN.
@needs_triton
@pytest.mark.parametrize("tiles", [(32, 16), (16, 32), (16, 16)], ids=["bm32_bn16", "bm16_bn32", "bm16_bn16"])
@pytest.mark.parametrize("n_q,n_k", [(70, 130), (130, 70)])
@pytest.mark.parametrize("causal", [True, False])
def test_fused_bwd_tile_pairing(tiles, n_q, n_k, causal):
    cfg = FlashConfig(backward="fused", poison_outputs=True, tiles={"fused": (*tiles, 4, 1)})
    torch.manual_seed(7)
    q, k, v = make_qkv((1, 1, n_q, 16), n_k, torch.float32)
    check_against_reference(triton_with(cfg), q, k, v, causal, TOL[torch.float32])


# Split-KV forward: each query tile's keys cut into splits, one program each, merged by logsumexp. Forced
# here (the interpreter never splits on its own): split lengths of one tile, several tiles and more keys than
# there are; causal rows that see no key at all (N_q > N_k); outputs poisoned with NaN. Backward on top.
# Every split length in bf16; fp32 (the same kernel, other casts and tolerances) with the most splits.
@needs_triton
@pytest.mark.parametrize("split_keys, dtype", [(1, torch.float32), (1, torch.bfloat16), (40, torch.bfloat16),
                                               (1000, torch.bfloat16)],
                         ids=["one_tile-fp32", "one_tile-bf16", "several_tiles-bf16", "one_split-bf16"])
@pytest.mark.parametrize("n_q,n_k,causal", [(70, 130, True), (130, 70, True), (90, 90, False)])
def test_split_kv_forward(split_keys, dtype, n_q, n_k, causal):
    cfg = FlashConfig(poison_outputs=True, split_keys=split_keys)
    torch.manual_seed(11)
    q, k, v = make_qkv((1, 2, n_q, 32), n_k, dtype)
    out, lse = flash_attention_with_lse(q.detach(), k.detach(), v.detach(), causal, cfg)
    ref, ref_lse = reference_attention(*(x.detach().double() for x in (q, k, v)), causal)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse.double()[finite] - ref_lse[finite]).abs().max() < (1e-2 if CUDA or dtype != torch.float32 else 1e-3)
    assert rel_err(out, ref) < TOL[dtype]
    check_against_reference(triton_with(cfg), q, k, v, causal, TOL[dtype])


@needs_triton
@pytest.mark.parametrize("merge", ["in_kernel", "separate"])
def test_split_kv_forward_with_a_tail_head_dim(merge):
    """d = 80 is tiled as 64 columns and a 16-column tail (`_tile_d`): the split forward's partial rows carry both
    parts through the merge (against float64, outputs poisoned, N_q != N_k, causal)."""
    cfg = FlashConfig(poison_outputs=True, split_keys=40, split_merge=merge)
    torch.manual_seed(13)
    q, k, v = make_qkv((1, 2, 70, 80), 130, torch.float32)
    out, lse = flash_attention_with_lse(q.detach(), k.detach(), v.detach(), True, cfg)
    ref, ref_lse = reference_attention(*(x.detach().double() for x in (q, k, v)), True)
    assert (lse.double() - ref_lse).abs().max() < (1e-2 if CUDA else 1e-3)  # TF32 dots on the GPU
    assert rel_err(out, ref) < TOL[torch.float32]


def test_head_dim_tiles():
    """A head dim is one power-of-two tile unless a power-of-two part and a smaller tail cover it in fewer
    columns (the matmuls then skip the padding): 80 = 64 + 16, 96 = 64 + 32, 48 = 32 + 16, 160 = 128 + 32."""
    from core.kernels.flash_triton.common import _tile_d
    assert {d: _tile_d(d) for d in (8, 16, 24, 48, 64, 80, 96, 100, 128, 160, 256)} == {
        8: (16, 0), 16: (16, 0), 24: (32, 0), 48: (32, 16), 64: (64, 0), 80: (64, 16), 96: (64, 32), 100: (128, 0),
        128: (128, 0), 160: (128, 32), 256: (256, 0)}


@needs_triton
@pytest.mark.parametrize("one_loop", [True, False], ids=["one_loop", "two_loops"])
def test_split_kv_merge_in_kernel_matches_two_launches(one_loop):
    """The one-launch split-KV forward (the split that arrives last merges, in split order) gives the two-launch
    forward's (`split_merge: separate`) output and logsumexp bit for bit, whether each split walks its keys in one
    masked loop or in an unmasked and a masked one, and leaves its arrival counts at 0 for the next launch (run
    twice)."""
    cfg = FlashConfig(split_keys=48, short_row_tiles=1 << 30 if one_loop else 0)
    torch.manual_seed(12)
    q, k, v = make_qkv((2, 2, 150, 32), 150, torch.bfloat16)
    q, k, v = (x.detach() for x in (q, k, v))
    two_out, two_lse = flash_attention_with_lse(q, k, v, True, cfg.replace(split_merge="separate"))
    for _ in range(2):
        out, lse = flash_attention_with_lse(q, k, v, True, cfg)
        assert torch.equal(out, two_out) and torch.equal(lse, two_lse)
    assert not ftl._ARRIVALS.get(q.device, 1).any()


def test_split_kv_policy(monkeypatch):
    """Split only where the one-kernel grid leaves SMs idle and rows are long: about 2 programs per SM, at most
    `max_splits` splits."""
    monkeypatch.setattr(ftc, "INTERPRET", False)
    monkeypatch.setattr(ftl, "_sm_count", lambda device: 132)
    dev = torch.device("cuda", 0)
    assert FlashConfig().max_splits == 4
    assert ftd._fwd_split_len(dev, 1, 4096, 4096, 64, 64) == 16 * 64    # 64 programs -> 4 splits (not 5) of 16 tiles
    assert ftd._fwd_split_len(dev, 1, 2048, 2048, 64, 64) == 8 * 64     # 32 programs -> 4 splits (not 8) of 8 tiles
    assert ftd._fwd_split_len(dev, 1, 8192, 8192, 64, 64) == 43 * 64    # 128 programs -> 3 splits of 43 tiles
    assert ftd._fwd_split_len(dev, 1, 1024, 1024, 64, 64) == 4 * 64     # 16 programs -> 4 splits of 4 tiles
    assert ftd._fwd_split_len(dev, 4, 1024, 1024, 64, 64) == 0          # 64 programs: rows of 16 tiles stay whole
    assert ftd._fwd_split_len(dev, 1, 960, 960, 64, 64) == 0            # 15 key tiles: one kernel
    assert ftd._fwd_split_len(dev, 16, 16384, 16384, 64, 64) == 0       # the leaderboard grid fills the GPU
    assert ftd._fwd_split_len(dev, 1, 16384, 16384, 64, 64) == 0        # 256 programs >= 132 SMs
    assert ftd._fwd_split_len(dev, 1, 4096, 4096, 64, 64, FlashConfig(split_kv=False)) == 0
    assert ftd._fwd_split_len(dev, 1, 2048, 2048, 64, 64, FlashConfig(max_splits=8)) == 4 * 64  # 8 splits of 4 tiles


def test_fused_grid_covers_both_tile_counts():
    assert ftl._grid("fused", 3, 70, 130, 32, 16) == (9, 3)    # 3 query tiles, 9 key tiles
    assert ftl._grid("fused", 3, 130, 70, 16, 32) == (9, 3)    # 9 query tiles, 3 key tiles
    assert ftl._grid("fused", 1, 1024, 1024, 64, 64) == (16, 1)
    # one head-major dimension: batch x heads x tiles
    assert ftl._grid("dq", 3, 70, 0, 32, 16) == (9,) and ftl._grid("dkdv", 3, 130, 0, 32, 16) == (27,)


@needs_triton
def test_bwd_variant_policy_and_launches(monkeypatch):
    """The default config takes the fused backward on small grids and the two-pass one on large grids
    (`_use_fused`, from the H100 measurements, its limits in the config); `backward` pins a variant; the fused
    variant is one backward launch, so forward + backward = 2 launches."""
    launched = []
    real_launch = ftd._launch

    def spy(name, *args, **kwargs):
        launched.append(name)
        return real_launch(name, *args, **kwargs)
    monkeypatch.setattr(ftd, "_launch", spy)
    q, k, v = make_qkv((1, 1, 20, 16), 20, torch.float32)
    # measured boundaries: d <= 64 up to 256 64-row tiles, d = 128 up to 128; the leaderboard grid is two-pass
    assert ftd._use_fused(1, 16384, 16384, 64) and not ftd._use_fused(1, 16385, 16385, 64)
    assert ftd._use_fused(1, 8192, 8192, 128) and not ftd._use_fused(1, 16384, 16384, 128)
    assert not ftd._use_fused(16, 16384, 16384, 64)
    assert ftd._use_fused(1, 20, 20, 16)
    assert not ftd._use_fused(1, 20, 20, 16, FlashConfig(fused_max_tiles=0))
    assert ftd._use_fused(2, 8192, 8192, 128, FlashConfig(fused_max_tiles_wide=256))

    def grads(cfg=None):
        launched.clear()
        return torch.autograd.grad(FlashAttentionTriton.apply(q, k, v, True, cfg).sum(), q)[0]

    g_fused = grads()
    assert launched == ["fwd", "fused"]
    grads(FUSED)
    assert launched == ["fwd", "fused"]
    no_fused = FlashConfig(fused_max_tiles=0)  # "auto" on a grid past the fused limit
    g_two = grads(no_fused)
    assert launched == ["fwd", "dq", "dkdv"]
    assert grads(TWO_PASS).equal(g_two) and launched == ["fwd", "dq", "dkdv"]
    grads(FUSED.replace(fused_max_tiles=0))  # a pinned variant ignores the policy's limits
    assert launched == ["fwd", "fused"]
    assert (g_fused - g_two).abs().max() < SAME_TOL  # another tiling: fp32 sums in another order
    with pytest.raises(ConfigError, match="unknown backward variant"):
        ftd.flash_bwd_impl(q, q, k, v, q, q[..., 0], True, "split")
    # batch x heads beyond the fused grid's dim-1 limit: the two-pass backward runs instead
    monkeypatch.setattr(ftl, "_MAX_GRID_Y", 0)
    g_big = grads(FUSED)
    assert launched == ["fwd", "dq", "dkdv"] and (g_big - g_two).abs().max() < SAME_TOL


@needs_triton
@BWD_CONFIGS
@pytest.mark.parametrize("causal", [True, False])
def test_triton_logsumexp_and_every_element_written(causal, cfg):
    cfg = cfg.replace(poison_outputs=True)  # outputs start as NaN: unwritten shows up
    torch.manual_seed(2)
    q, k, v = make_qkv((1, 2, 45, 16), 30, torch.float32)
    out, lse = flash_attention_with_lse(q.detach(), k.detach(), v.detach(), causal, cfg)
    ref, ref_lse = reference_attention(q.detach(), k.detach(), v.detach(), causal)
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)  # rows that see no key: -inf, output 0
    # fp32 runs its dots in TF32 on the GPU (10-bit mantissa): logsumexp is then good to ~1e-3 relative
    assert (lse.double()[finite] - ref_lse[finite]).abs().max() < (1e-2 if CUDA else 1e-3)
    assert rel_err(out, ref) < TOL[torch.float32]
    # backward writes every gradient element too
    q.grad = k.grad = v.grad = None
    FlashAttentionTriton.apply(q, k, v, causal, cfg).sum().backward()
    assert not any(torch.isnan(g).any() for g in (q.grad, k.grad, v.grad))


def test_torch_logsumexp_matches():
    torch.manual_seed(3)
    from core.kernels.flash_torch import flash_forward
    q, k, v = (torch.randn(2, 70, 16) for _ in range(3))
    _, lse = flash_forward(q, k, v, True)
    _, ref_lse = reference_attention(q, k, v, True)
    assert (lse.double() - ref_lse).abs().max() < 1e-4


@pytest.mark.parametrize("fn_cls", [pytest.param(FlashAttentionTorch, id="flash_torch"),
                                    pytest.param(FlashAttentionTriton, id="flash_triton", marks=needs_triton)])
def test_saves_one_logsumexp(fn_cls):
    """q, k, v, the output and one (..., N_q) fp32 logsumexp: what autograd packs for backward."""
    q, k, v = make_qkv((1, 2, 20, 16), 20, torch.float32)
    _assert_saves_one_logsumexp(fn_cls, q, k, v)


@pytest.mark.parametrize("fn_cls", [pytest.param(FlashAttentionTorch, id="flash_torch"),
                                    pytest.param(FlashAttentionTriton, id="flash_triton", marks=needs_triton)])
@pytest.mark.parametrize("shape", [(3, 20, 16), (20, 16), (2, 1, 2, 20, 16)], ids=["3d", "2d", "5d"])
def test_saved_logsumexp_has_the_inputs_leading_dims(fn_cls, shape):
    """(batch, seq, d) inputs save a (batch, seq) logsumexp, not the kernels' 4-D (1, batch, seq); likewise 2-D
    and 5-D inputs; the backward through it still matches float64."""
    torch.manual_seed(4)
    q, k, v = (torch.randn(shape, device=DEVICE).requires_grad_() for _ in range(3))
    _assert_saves_one_logsumexp(fn_cls, q, k, v)
    check_against_reference(fn_cls.apply, q, k, v, True, TOL[torch.float32])


def _assert_saves_one_logsumexp(fn_cls, q, k, v):
    for _ in range(2):  # the second call takes the direct launches on a GPU
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            out = fn_cls.apply(q, k, v, True)
        assert len(packed) == 5
        lse = packed[4]
        assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32
        assert sum(t.shape == q.shape[:-1] for t in packed) == 1
        assert packed[3].data_ptr() == out.data_ptr()


@pytest.mark.parametrize("fn", IMPLS)
def test_autocast(fn):
    torch.manual_seed(4)
    q, k, v = make_qkv((1, 2, 32, 32), 32, torch.float32)
    low = torch.bfloat16
    with torch.autocast(DEVICE, dtype=low):
        out = fn(q, k, v, True)
    assert out.dtype == low
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32
    ref, _ = reference_attention(q.detach().to(low), k.detach().to(low), v.detach().to(low), True)
    assert rel_err(out, ref) < TOL[low]


@needs_triton
@pytest.mark.parametrize("cfg", [None, TWO_PASS, FlashConfig(split_keys=16, backward="atomic_dq")],
                         ids=["default", "two_pass", "split_atomic_dq"])
def test_torch_compile_fullgraph(cfg):
    """Under torch.compile the Function calls the custom ops, the config travelling as its key string: the same
    output and gradients as eager with the same config."""
    torch.manual_seed(5)
    q, k, v = make_qkv((1, 2, 24, 16), 24, torch.float32, noncontig=True)

    def f(q, k, v):
        return FlashAttentionTriton.apply(q * 1.0, k, v, True, cfg) * 2.0

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager" if not CUDA else "inductor")
    out = compiled(q, k, v)
    ref = f(q, k, v)
    assert (out - ref).abs().max() < 1e-5
    out.sum().backward()
    g = q.grad.clone()
    q.grad = None
    ref.sum().backward()
    assert (g - q.grad).abs().max() < 1e-5


@needs_triton
def test_torch_compile_traces_the_backward_without_its_variant_checks(monkeypatch):
    """The backward variant is picked when the op runs, on the real operands, not while torch.compile traces the
    Function: the Gluon kernel's checks read the operands' addresses (Tensor.data_ptr), which Dynamo cannot trace,
    and the Function would leave the graph (a graph break at every attention call of a compiled model). Here the
    policy reaches those checks (no fused backward, the Gluon threshold at 0), and they read data_ptr as on
    Hopper; the compile is fullgraph."""
    seen = []

    def ws_ok(q, do, d, cfg):
        seen.append(ftc._tma_aligned(q) and ftc._tma_aligned(do))
        return False  # the CPU runs the Triton kernels (interpreter)
    monkeypatch.setattr(ftd, "_ws_ok", ws_ok)
    cfg = FlashConfig(fused_max_tiles=0, ws_min_rows=0)
    torch.manual_seed(7)
    q, k, v = make_qkv((1, 2, 24, 16), 24, torch.float32)

    def f(q, k, v):
        return FlashAttentionTriton.apply(q, k, v, True, cfg)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager" if not CUDA else "inductor")
    grads = torch.autograd.grad(compiled(q, k, v).square().sum(), (q, k, v))
    assert seen == [True]  # once, when the backward ran, on real tensors
    ref = torch.autograd.grad(f(q, k, v).square().sum(), (q, k, v))
    assert all((g - r).abs().max() < 1e-5 for g, r in zip(grads, ref))


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_compiled_model_with_flash_triton_is_one_graph(tmp_path):
    """torch.compile makes the model with flash_triton one graph, as with sdpa: no break at its attention calls
    (the Gluon backward's checks are reached, head dim 64 with the policy's thresholds at 0, and not traced)."""
    from core.trainer import build
    from tests.utils import compose_cfg
    for impl in ("sdpa", "flash_triton"):
        extra = ["attention_impl.config.fused_max_tiles=0", "attention_impl.config.ws_min_rows=0"] \
            if impl == "flash_triton" else []
        run = build(compose_cfg([f"attention_impl={impl}", "model.d_model=256", "model.n_kv_heads=2",
                                 "model.context_length=256", "logger=none", *extra], tmp_path / impl))
        model = run.raw_model.to(torch.bfloat16)
        tokens = torch.randint(0, 256, (2, 256), device=next(model.parameters()).device)
        explained = torch._dynamo.explain(model)(tokens)
        assert explained.graph_break_count == 0, (impl, [b.reason[:300] for b in explained.break_reasons])
        torch._dynamo.reset()


@needs_triton
def test_torch_compile_passes_the_model_do_view_without_a_copy():
    """Compiled, the backward hands the custom op dO as the model makes it, a (B, T, H, d) view, not a contiguous
    copy: Dynamo copies a gradient whose strides an autograd.Function's backward reads while it is traced, so the
    Function must not read them. The gradients equal eager's."""
    from torch._dynamo.backends.common import aot_autograd
    torch.manual_seed(6)
    b, t, h, d = 2, 24, 2, 16
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    def f(qkv, w):
        q, k, v = qkv.transpose(1, 2).split([h, h, h], dim=1)
        return FlashAttentionTriton.apply(q, k, v, True).transpose(1, 2).reshape(b, t, h * d) @ w

    qkv = torch.randn(b, t, 3 * h, d, device=DEVICE, requires_grad=True)
    w = torch.randn(h * d, 8, device=DEVICE, requires_grad=True)
    compiled = torch.compile(f, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    grads = torch.autograd.grad(compiled(qkv, w).square().sum(), (qkv, w))
    ref = torch.autograd.grad(f(qkv, w).square().sum(), (qkv, w))
    assert all((g - r).abs().max() < 1e-5 for g, r in zip(grads, ref))
    backward = graphs[-1].graph
    [op] = [n for n in backward.nodes if n.target is torch.ops.scalelab.flash_attn_bwd.default]
    producers, todo = set(), [op.args[0]]
    while todo:  # dO's producers back to the matmul's gradient: views only
        node = todo.pop()
        producers.add(node.target)
        if node.target is not torch.ops.aten.mm.default:
            todo += [a for a in node.args if isinstance(a, torch.fx.Node)]
    assert torch.ops.aten.clone.default not in producers, producers


@needs_triton
def test_custom_op_registered():
    q, k, v = (torch.randn(1, 1, 8, 16, device=DEVICE) for _ in range(3))
    out, lse = torch.ops.scalelab.flash_attn_fwd(q, k, v, True)
    assert out.shape == q.shape and lse.shape == (1, 1, 8)
    torch.library.opcheck(torch.ops.scalelab.flash_attn_fwd.default, (q, k, v, True),
                          test_utils=("test_schema", "test_faketensor"))
    do = torch.randn_like(out)
    ref = None
    # bwd_variant 0 two-pass, 1 atomic dQ, 2 fused; a bool still binds (the former atomic_dq argument)
    for variant in (0, 1, 2, True):
        grads = torch.ops.scalelab.flash_attn_bwd(do, q, k, v, out, lse, True, variant)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        ref = ref or grads
        assert max((g - r).abs().max().item() for g, r in zip(grads, ref)) < SAME_TOL
        if variant is not True:
            torch.library.opcheck(torch.ops.scalelab.flash_attn_bwd.default, (do, q, k, v, out, lse, True, variant),
                                  test_utils=("test_schema", "test_faketensor"))
    grads = torch.ops.scalelab.flash_attn_bwd(do, q, k, v, out, lse, True)  # default: two-pass
    assert max((g - r).abs().max().item() for g, r in zip(grads, ref)) < SAME_TOL
    # the config as its key string: a forced split forward, the same output
    key = FlashConfig(split_keys=16).key
    out2, lse2 = torch.ops.scalelab.flash_attn_fwd(q, k, v, True, key)
    assert (out2 - out).abs().max() < SAME_TOL and (lse2 - lse).abs().max() < SAME_TOL
    torch.library.opcheck(torch.ops.scalelab.flash_attn_fwd.default, (q, k, v, True, key),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("fn", IMPLS)
@pytest.mark.parametrize("bad,match", [
    (dict(d_k=8), "head dims differ"),
    (dict(dtype=torch.float64), "dtype"),
    (dict(d=264), "head dim 264"),
    (dict(lead_k=3), "leading dims differ"),
])
def test_errors(fn, bad, match):
    d = bad.get("d", 16)
    dtype = bad.get("dtype", torch.float32)
    q = torch.randn(1, 2, 8, d, dtype=dtype, device=DEVICE)
    k = torch.randn(1, bad.get("lead_k", 2), 8, bad.get("d_k", d), dtype=dtype, device=DEVICE)
    v = torch.randn(1, bad.get("lead_k", 2), 8, bad.get("d_k", d), dtype=dtype, device=DEVICE)
    with pytest.raises(ConfigError, match=match):
        fn(q, k, v, True)


def test_bench_model_layout_inputs():
    """--layout model: q, k, v are views of one fused (B, S, H + 2 KV, d) projection at the model's strides, and dO
    is a (B, S, H, d) tensor seen as (B, H, S, d); dense: contiguous (B, H, S, d) leaves."""
    from experiments import attention_bench as bench
    b, h, s, d, kv = 2, 4, 8, 16, 2
    q, k, v, do = bench.make_inputs(bench.Shape(b, h, s, d, torch.float32, True, kv, "model"), device="cpu")
    width = (h + 2 * kv) * d
    assert q.shape == (b, h, s, d) and k.shape == v.shape == (b, kv, s, d) and do.shape == (b, h, s, d)
    for t in (q, k, v):
        assert t.stride() == (s * width, d, width, 1) and t._base is q._base and q._base.requires_grad
    assert (k.data_ptr() - q.data_ptr(), v.data_ptr() - k.data_ptr()) == (h * d * 4, kv * d * 4)
    assert do.stride() == (s * h * d, d, h * d, 1)
    q, k, v, do = bench.make_inputs(bench.Shape(b, h, s, d, torch.float32, True, kv), device="cpu")
    assert all(t.is_contiguous() and t.is_leaf and t.requires_grad for t in (q, k, v)) and do.is_contiguous()


def test_bench_training_shapes(capsys):
    """--preset training: B x S tokens a row (65536 by default, --tokens otherwise), 16 heads; masks and GQA rows
    (also, or only those); --tokens below 1 refused in one line."""
    import experiments.attention_bench as bench
    rows = bench.training_shapes([512, 2048], [64], [torch.bfloat16])
    assert [(r.b, r.h, r.s, r.causal, r.kv_heads) for r in rows] == [(128, 16, 512, True, 0), (32, 16, 2048, True, 0)]
    rows = bench.training_shapes([2048], [64, 128], [torch.bfloat16], "both", "also", tokens=16384)
    assert {(r.b, r.d, r.causal, r.kv_heads) for r in rows} == {(8, d, c, g) for d in (64, 128) for c in (True, False)
                                                                for g in (0, 4)}
    rows = bench.training_shapes([2048], [80], [torch.float16], "no", "only")
    assert [(r.d, r.causal, r.kv_heads) for r in rows] == [(80, False, 4)]
    assert bench.training_shapes([4096], [64], [torch.bfloat16], tokens=1024)[0].b == 1  # at least one sequence
    with pytest.raises(SystemExit) as exc:
        bench.main(["--preset", "training", "--tokens", "0"])
    assert exc.value.code == 2 and "--tokens 0" in capsys.readouterr().err


def test_bench_round_medians():
    """--rounds: each mode's median over the rounds; a failed round marks the cell."""
    import experiments.attention_bench as bench
    runs = [{"fwd": 3.0, "bwd": 1.0}, {"fwd": 1.0, "bwd": 9.0}, {"fwd": 2.0, "bwd": 2.0}]
    assert bench._median_result(runs) == {"fwd": 2.0, "bwd": 2.0}
    assert bench._median_result(runs + [{"oom": True}]) == {"oom": True}


def test_bench_rounds_alternate_order_and_time_enough_calls(monkeypatch):
    """--rounds: every implementation is prepared, then each mode is timed for the implementations in turn (the
    times a ratio compares taken next to each other), in reverse order every second round; a ratio is the median of
    the rounds' ratios; an implementation that fails is left out of the round's timings; --min-calls: each time is a
    do_bench median over at least that many calls (its rep stretched to min_calls calls of the measured length)."""
    import experiments.attention_bench as bench
    real_bench = bench._bench
    timed, prepared = [], []
    times = {"a": [1.0, 4.0, 1.0, 4.0], "b": [2.0, 2.0, 2.0, 2.0]}  # a is slower every second round

    def fake_prepare(fn, res, shape, graph=False):
        prepared.append(fn)
        if fn == "c":
            raise RuntimeError("refuses the shape")
        res["mem_mib"] = 0.0
        return {mode: (fn, mode) for mode in bench.MODES}

    def fake_bench(call, warmup, rep, min_calls):
        impl, mode = call
        timed.append((impl, mode, min_calls))
        return times[impl][sum(1 for i, m, _ in timed if (i, m) == (impl, mode)) - 1]
    monkeypatch.setattr(bench, "_prepare", fake_prepare)
    monkeypatch.setattr(bench, "_bench", fake_bench)
    monkeypatch.setattr(bench, "make_impl", lambda impl: impl)
    shape = bench.Shape(1, 2, 64, 16, torch.bfloat16, True)
    results = bench.run_table([shape], ["a", "b", "c"], 1, 5, {torch.bfloat16: 100.0}, [], "t", rounds=4,
                              min_calls=7)
    assert prepared == list("abccbaabccba") and {m for _, _, m in timed} == {7}
    assert [(i, m) for i, m, _ in timed[:6]] == [(i, m) for m in bench.MODES for i in "ab"]  # round 0: a, b a mode
    assert [i for i, m, _ in timed[6:8]] == ["b", "a"]  # round 1: reversed
    assert results[(shape, "c")]["error"] == "refuses the shape"
    a, b = results[(shape, "a")], results[(shape, "b")]
    assert a["fwd"] == 4.0 and b["fwd"] == 2.0  # medians (the upper of an even count)
    assert bench._ratio(a, b, "fwd") == 1.25  # the median of 0.5, 2, 0.5, 2: not 4 / 2
    assert bench._ratio({"fwd": 3.0}, {"fwd": 2.0}, "fwd") == 1.5  # no rounds: the ratio of the medians
    # the table's cell: the median and the rounds' range; without rounds the ratio alone; unmeasured "-"
    assert bench._ratio_cell(a, b, "fwd") == "1.25 [0.50-2.00]"
    assert bench._ratio_cell({"fwd": 3.0}, {"fwd": 2.0}, "fwd") == "1.50"
    assert bench._ratio_cell(a, {"oom": True}, "fwd") == "-"

    reps = []
    monkeypatch.setattr(bench, "_one_call_ms", lambda fn: 30.0)
    monkeypatch.setattr(bench, "do_bench", lambda fn, warmup, rep, return_mode: reps.append(rep) or 1.0)
    real_bench(lambda: None, 10, 60, 20)
    real_bench(lambda: None, 10, 60, 1)
    assert reps == [600.0, 60]


@needs_triton
def test_bench_impls_on_cpu():
    """experiments/attention_bench.py builds every flash_triton impl (config overrides included) without a GPU;
    its timing loop itself needs CUDA, and says so."""
    from experiments import attention_bench as bench
    assert {"flash_triton", "flash_triton_atomic", "flash_triton_fused"} <= set(bench.ALL_IMPLS)
    assert bench.triton_config("flash_triton_fused@fused=16x16x4x1,split_merge=separate,hopper_ws=0") == \
        FlashConfig(backward="fused", tiles={"fused": (16, 16, 4, 1)}, split_merge="separate", hopper_ws=False)
    assert bench.triton_config("flash_triton") == FlashConfig()
    q, k, v = make_qkv((1, 1, 40, 16), 40, torch.float32)
    grads = []
    for name in ("flash_triton", "flash_triton_fused", "flash_triton_fused@fused=16x16x4x1",
                 "flash_triton@split_keys=16,split_merge=separate"):
        fn = bench.make_impl(name)
        grads.append(torch.autograd.grad(fn(q, k, v).sum(), (q, k, v)))
    for g in grads[1:]:
        assert max((a - b).abs().max().item() for a, b in zip(g, grads[0])) < SAME_TOL
    # grouped-query rows (2 query heads per KV head) and non-causal rows, against float64
    q2 = torch.randn(1, 2, 40, 16, device=DEVICE)
    k2, v2 = (torch.randn(1, 1, 40, 16, device=DEVICE) for _ in range(2))
    for causal in (True, False):
        out = bench.make_impl("flash_triton")(q2, k2, v2, causal)
        ref, _ = reference_attention(q2, k2.expand(1, 2, 40, 16), v2.expand(1, 2, 40, 16), causal)
        assert rel_err(out, ref) < TOL[torch.float32]
    with pytest.raises(ValueError, match="unknown impl"):
        bench.make_impl("flash_triton_split")
    with pytest.raises(ConfigError, match="unknown override"):
        bench.make_impl("flash_triton@merge=0")
    if not CUDA:
        assert bench.main(["--preset", "quick", "--impls", "flash_triton_fused"]) == 2


def test_triton_refuses_cpu_without_interpreter(monkeypatch):
    monkeypatch.setattr(ftc, "INTERPRET", False)
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(ConfigError, match="CUDA only"):
        ft.flash_fwd_impl(q, q, q, True)


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@BWD_CONFIGS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_larger_shapes(dtype, cfg):
    torch.manual_seed(6)
    q, k, v = make_qkv((2, 4, 1000, 64), 1000, dtype, noncontig=True)
    check_against_reference(triton_with(cfg), q, k, v, True, TOL[dtype])
    q, k, v = make_qkv((1, 2, 300, 128), 777, dtype)
    check_against_reference(triton_with(cfg), q, k, v, True, TOL[dtype])


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@BWD_CONFIGS
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 80), (torch.float16, 80), (torch.float32, 80),
                                     (torch.bfloat16, 96), (torch.bfloat16, 160), (torch.float16, 192),
                                     (torch.bfloat16, 256), (torch.float32, 256)],
                         ids=lambda x: str(x).replace("torch.", ""))
def test_gpu_head_dims(d, dtype, cfg):
    """Every head-dim class on the GPU's compiled kernels (autotuned tiles, each backward variant): the padded
    80 / 96, and 160-256, whose 256-wide tiles only fit in the smaller configurations; GQA-sized grids with a ragged
    last tile, causal and not."""
    torch.manual_seed(d)
    for causal in (True, False):
        q, k, v = make_qkv((2, 4, 1000, d), 1000, dtype)
        check_against_reference(triton_with(cfg), q, k, v, causal, TOL[dtype])


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [80, 256])
def test_gpu_head_dims_on_the_split_forward_grid(d):
    """B = H = 1 long rows: d = 80 takes the split-KV forward (tiles sized for d <= 128), d = 256 the one kernel."""
    torch.manual_seed(d)
    q, k, v = make_qkv((1, 1, 4096, d), 4096, torch.bfloat16)
    check_against_reference(FlashAttentionTriton.apply, q, k, v, True, TOL[torch.bfloat16])


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [1024, 2048, 1500], ids=["short_rows", "long_rows", "ragged"])
@pytest.mark.parametrize("dtype,d", [(torch.float32, 128), (torch.float16, 96), (torch.bfloat16, 16)],
                         ids=["fp32_d128", "fp16_d96", "bf16_d16"])
def test_gpu_split_forward_at_its_own_tiles(n, dtype, d):
    """The split-KV forward chosen on its own (B = H = 1; 32-row tiles and one loop for rows under 32 key tiles,
    64-row tiles and two loops above; a ragged last tile): every dtype and head dim it gets fits its fixed tiles
    and matches float64, causal and not, with outputs poisoned first."""
    assert ftd._fwd_split_len(torch.device("cuda"), 1, n, n, 64, 64) > 0  # the split path, not the one kernel
    torch.manual_seed(9)
    for causal in (True, False):
        q, k, v = make_qkv((1, 1, n, d), n, dtype)
        out, lse = flash_attention_with_lse(q.detach(), k.detach(), v.detach(), causal,
                                            FlashConfig(poison_outputs=True))
        ref, ref_lse = reference_attention(*(x.detach().double() for x in (q, k, v)), causal)
        assert rel_err(out, ref) < TOL[dtype]
        assert (lse.double() - ref_lse).abs().max() < 1e-2


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_memory_linear_in_sequence():
    peaks = []
    for s in (4096, 8192):
        q, k, v = make_qkv((1, 4, s, 64), s, torch.bfloat16)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        FlashAttentionTriton.apply(q, k, v, True).sum().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    assert peaks[1] < 2.5 * peaks[0]  # quadratic would be ~4x


@needs_triton
@BWD_CONFIGS
def test_expanded_kv_overlapping_layout(cfg):
    """k and v expanded over heads (stride 0, as grouped-query attention can pass them) and an expanded q: read in
    place, while each output (O, dQ, dK, dV) gets a dense layout of its own (an output aliased like its operand
    would have every head write the same memory); autograd sums dK, dV over the expansion."""
    torch.manual_seed(8)
    q = torch.randn(1, 1, 40, 16, device=DEVICE).expand(2, 3, 40, 16).requires_grad_()
    k = torch.randn(2, 1, 33, 16, device=DEVICE).expand(2, 3, 33, 16).requires_grad_()
    v = torch.randn(2, 1, 33, 16, device=DEVICE).expand(2, 3, 33, 16).requires_grad_()
    check_against_reference(triton_with(cfg), q, k, v, True, TOL[torch.float32])


def _recording_kernel(monkeypatch, arg_names: list[str], calls: list):
    """A stand-in for a JIT kernel whose launches `launch._run` makes: each launch through JITFunction.run appends
    ("jit", args) to calls, each through the compiled kernel's launcher ("direct", launcher args); the direct path
    enabled as on a GPU (device 0, stream 7), with an empty launcher cache."""
    class Compiled:
        function, packed_metadata = "fn", (4, 1, 0)

        def launch_metadata(self, grid, stream, *args):
            return None

        def run(self, *args):
            calls.append(("direct", args))

    class Jit:
        def run(self, *args, grid, warmup, **meta):
            calls.append(("jit", args))
            return Compiled()

    Jit.arg_names = arg_names
    monkeypatch.setattr(ftc, "INTERPRET", False)
    monkeypatch.setattr(ftl, "_direct_ok", True)
    monkeypatch.setattr(ftl, "_LAUNCHERS", {})
    monkeypatch.setattr(ftl, "_current_device", lambda: 0)
    monkeypatch.setattr(ftl, "_current_stream", lambda device: 7)
    return Jit()


@needs_triton
def test_direct_launch_cache_matches_triton_specialization(monkeypatch):
    """`_run` launches a cached compiled kernel only for the same constexprs, integer values, dtype and
    16-byte alignment of every pointer (what Triton specializes on), appending the constexprs in the
    kernel's parameter order; anything else goes through JITFunction.run."""
    calls = []
    raw = _recording_kernel(monkeypatch, ["X", "Y", "n", "scale", "A", "B"], calls)
    x, y = torch.zeros(64), torch.zeros(64)
    launch = lambda *args, **meta: ftl._run(raw, (2, 3), args, 2, **meta)  # noqa: E731
    launch(x, y, 5, 0.5, A=1, B=2, num_warps=4)
    launch(x, y, 5, 0.5, A=1, B=2, num_warps=4)               # same signature: direct
    launch(x, y[1:], 5, 0.5, A=1, B=2, num_warps=4)           # a pointer off 16-byte alignment
    launch(x, y, 6, 0.5, A=1, B=2, num_warps=4)               # another integer value
    launch(x, y, 5, 0.5, A=1, B=3, num_warps=4)               # another constexpr
    launch(x.double(), y.double(), 5, 0.5, A=1, B=2, num_warps=4)  # another dtype
    launch(x, y.double(), 5, 0.5, A=1, B=2, num_warps=4)      # another dtype of a later pointer only
    assert [c[0] for c in calls] == ["jit", "direct", "jit", "jit", "jit", "jit", "jit"]
    direct = calls[1][1]
    assert direct[:4] == (2, 3, 1, 7) and direct[4:6] == ("fn", (4, 1, 0))
    assert direct[9:11] == (x, y) and direct[11:] == (5, 0.5, 1, 2)  # constexprs A, B after the runtime args


@needs_triton
def test_replay_relaunches_a_direct_launch_with_new_tensors(monkeypatch):
    """`_run(..., replay=True)` gives a `Replay` only for a direct launch that ran (not the first, compiling one);
    the replay launches the same compiled kernel at the same grid, scalars and constexprs with new leading
    tensors, without hooks or metadata."""
    calls = []
    raw = _recording_kernel(monkeypatch, ["X", "Y", "n", "A"], calls)
    x, y, x2, y2 = (torch.zeros(64) for _ in range(4))
    assert ftl._run(raw, (2,), (x, y, 5), 2, True, A=3, num_warps=4) is None
    replay = ftl._run(raw, (2,), (x, y, 5), 2, True, A=3, num_warps=4)
    replay(x2, y2)
    assert [c[0] for c in calls] == ["jit", "direct", "direct"]
    first, again = calls[1][1], calls[2][1]
    assert again[:4] == first[:4] == (2, 1, 1, 7) and again[6:9] == (None, None, None)
    assert again[9:11] == (x2, y2) and again[11:] == first[11:] == (5, 3)


@needs_triton
def test_launch_hooks_count_only_when_set(monkeypatch):
    """A direct launch passes Triton's launch hooks only where one is set: Triton 3.6's empty hook chains count as
    none (no metadata built, nothing called per launch), a chain with a hook or a plain hook counts, and replays
    wait for none to be set."""
    import triton
    monkeypatch.setattr(ftl, "_direct_ok", True)
    runtime = triton.knobs.runtime

    class Chain:  # Triton 3.6's HookChain
        def __init__(self, calls):
            self.calls = calls

    def hook(metadata):
        return None

    for enter, leave, want in ((None, None, (None, None)), (Chain([]), Chain([]), (None, None)),
                               (Chain([hook]), Chain([]), (1, None)), (hook, None, (1, None)), (None, hook, (None, 1))):
        monkeypatch.setattr(runtime, "launch_enter_hook", enter)
        monkeypatch.setattr(runtime, "launch_exit_hook", leave)
        got = ftl._hooks()
        assert tuple(None if h is None else 1 for h in got) == want
        assert ftl.replays_ok() == (want == (None, None))


@needs_triton
def test_direct_launch_cache_keys_tma_descriptors(monkeypatch):
    """For host TMA descriptors (the Gluon kernels' arguments) `_run` keys what Triton specializes on, the tensor's
    dtype, the box and the shared-memory layout, not the tensor's shape or strides: a descriptor over another
    tensor of another shape launches directly, another box, layout or dtype goes through JITFunction.run."""
    from core.kernels.flash_triton import hopper
    if not hopper.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    calls = []
    raw, lse = _recording_kernel(monkeypatch, ["D", "L", "n", "A"], calls), torch.zeros(64)
    launch = lambda desc: ftl._run(raw, (4,), (desc, lse, 3), 2, A=1, num_warps=4)  # noqa: E731
    small, large = torch.zeros(1, 2, 128, 64, dtype=torch.bfloat16), torch.zeros(3, 4, 512, 64, dtype=torch.bfloat16)
    launch(hopper.tma_desc(small, (1, 1, 64, 64)))
    launch(hopper.tma_desc(large, (1, 1, 64, 64)))                  # another shape and strides: direct
    launch(hopper.tma_desc(large, (1, 1, 128, 64)))                 # another box
    launch(hopper.tma_desc(large, (1, 1, 64, 64), swizzled=False))  # another shared-memory layout
    launch(hopper.tma_desc(large.half(), (1, 1, 64, 64)))           # another dtype
    launch(None)  # no descriptor (the Gluon forward's tails without a tail): a constexpr, its own kernel
    launch(None)
    assert [c[0] for c in calls] == ["jit", "direct", "jit", "jit", "jit", "jit", "direct"]
    assert calls[1][1][-4].base is large  # the call's own descriptor goes to the launcher


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("seq", [300, 2048])
def test_gpu_direct_launches_repeat_exactly(seq, monkeypatch):
    """Repeated calls (the cached direct launches) give the float64-checked results bit for bit, also for
    inputs that are views at other alignments; and equal what JITFunction.run launches give."""
    torch.manual_seed(9)
    q, k, v = make_qkv((1, 2, seq, 64), seq, torch.bfloat16)
    check_against_reference(FlashAttentionTriton.apply, q, k, v, True, TOL[torch.bfloat16])
    runs = []
    for fast in (True, True, False):
        monkeypatch.setattr(ftl, "_direct_ok", fast)  # False: every launch through JITFunction.run
        q.grad = k.grad = v.grad = None
        out = FlashAttentionTriton.apply(q, k, v, True)
        out.backward(torch.ones_like(out))
        runs.append([t.detach().clone() for t in (out, q.grad, k.grad, v.grad)])
    monkeypatch.setattr(ftl, "_direct_ok", True)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    buf = torch.randn(seq * 64 * 2 + 8, device="cuda", dtype=torch.bfloat16)
    for offset in (0, 8, 4):  # 16-byte aligned views, then one that is not
        qv = buf[offset:offset + seq * 64 * 2].view(1, 2, seq, 64).detach().requires_grad_()
        kv, vv = (x.detach().requires_grad_() for x in (k, v))  # fresh leaves: .grad starts empty
        check_against_reference(FlashAttentionTriton.apply, qv, kv, vv, True, TOL[torch.bfloat16])


# ------------------------------------------------------------------ the warp-specialised Gluon backward (Hopper)
# what every Gluon compile script starts with (`compile_in_child`): compile_sm90(kernel, constexprs, types) compiles
# for sm_90a, its arguments typed as named in `types`, else upper-case ones as bf16 pointers and lower-case ones as
# scalars (fp32 for the scales, i32 else)
_SM90_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource


def compile_sm90(jf, constexprs, types):
    sig = {}
    for name in jf.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in types:
            sig[name] = types[name]
        elif name.isupper():
            sig[name] = "*bf16"
        else:
            sig[name] = "fp32" if name.endswith("scale") else "i32"
    return triton.compile(GluonASTSource(fn=jf, signature=sig, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 128), options={"num_warps": 4})
"""

_GLUON_COMPILE = """
import sys
from core.kernels.flash_triton import hopper as fg


def check(head_dim, heads):
    assert head_dim in fg.HEAD_DIMS
    import torch
    from triton.runtime.jit import mangle_type
    constexprs = dict(IS_CAUSAL=True, **fg.ws_constexprs(head_dim, heads))
    q = torch.empty(1, 1, 64, head_dim, dtype=torch.bfloat16)  # descriptors made on the host (`launch_ws`)
    descs = fg.ws_descs(q, q, torch.empty(1, 1, 64, 2), torch.empty(1, 1, 64, head_dim))
    types = {name: mangle_type(desc) for name, desc in zip(fg._bwd_ws_kernel.arg_names, descs)}
    kernel = compile_sm90(fg._bwd_ws_kernel, constexprs, types)
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and kernel.asm["cubin"]
    # no descriptor made on the device (per program they cost where its work is short)
    assert "tensormap.replace" not in ptx
    # 80 / 96: the head dim's tail in wgmmas of its own width (dV's and dK's tails), no 128-wide padded tiles
    tail = constexprs["D_TAIL"]
    assert (f"m64n{tail}k16" in ptx) == bool(tail) and ("m64n128k16" in ptx) == (head_dim == 128)
    # dQ parts added with bulk tensor reductions, from two warpgroups (8 warps), within Hopper's 227 KB per program
    assert "cp.reduce.async.bulk.tensor" in ptx and kernel.metadata.num_warps == 8
    assert kernel.metadata.shared <= 232448, kernel.metadata.shared
    # ptxas keeps the wgmmas asynchronous: short of registers it serializes every one (info C7512; the GPU machine's
    # Triton 3.6 ptxas did so at head dim 128 with dK's dS^T as a register operand, 1.08-1.11x the time)
    import os, subprocess, tempfile
    from triton.backends.nvidia.compiler import get_ptxas  # the ptxas this Triton compiles sm_90 code with
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        open(src, "w").write(ptx)
        log = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", src, "-o", out], capture_output=True,
                             text=True, timeout=240)
    assert log.returncode == 0 and "C7512" not in log.stdout + log.stderr, (log.stdout + log.stderr)[-2000:]


for arg in sys.argv[1:]:  # "64x1 80x4 ...": head dim x query heads a program walks
    check(*map(int, arg.split("x")))
    print("compiled", arg)
"""


def compile_in_child(script: str, *args: str) -> str:
    """Run a Gluon compile script (after `_SM90_COMPILE`) in a child process without TRITON_INTERPRET (this
    process's Triton may run kernels under the interpreter, which does not compile); it must print "compiled".
    Returns its stdout."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", _SM90_COMPILE + script, *args], env=env, cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "compiled" in res.stdout, res.stdout[-1000:] + res.stderr[-3000:]
    return res.stdout


@pytest.mark.slow  # cold (a CI machine's empty Triton cache): 30-45 s
def test_gluon_ws_compiles_for_sm90():
    """The Gluon backward compiles for sm_90a with the installed Triton, no GPU needed (the CPU machines run a
    newer Triton than the GPU machine, and Gluon's API moves between releases), at each head dim it takes, with a
    program per query head and per KV head of 4 query heads (`FlashConfig.ws_gqa_heads`). One child process
    compiles them all (an interpreter's start each would be most of the test's time)."""
    from core.kernels.flash_triton import hopper
    if not hopper.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    shapes = ["64x1", "96x1", "80x4", "128x4"]  # each head dim; per query head and per KV head twice
    out = compile_in_child(_GLUON_COMPILE, *shapes)
    assert [line.split()[1] for line in out.splitlines() if line.startswith("compiled ")] == shapes, out


def _frag_position(rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a d = 64 / 128 dQ element (row, column of its 64-row query tile) sits in the Gluon backward's dQ buffer:
    its (64-column block, index within the block) as the wgmma accumulator holds it. Thread t = 32 w + 4 lr + lc of
    warp w holds rows 16 w + 8 h + lr and columns 8 j + 2 lc + e of each 64-column block, as 32 values ordered
    (j, h, e)."""
    w, h, lr = rows // 16, rows // 8 % 2, rows % 8
    half, j, lc, e = cols // 64, cols % 64 // 8, cols % 8 // 2, cols % 2
    return half, (32 * w + 4 * lr + lc) * 32 + 4 * j + 2 * h + e


@needs_triton
@pytest.mark.parametrize("d", [64, 80, 96, 128])
@pytest.mark.parametrize("n_q", [128, 200])
def test_ws_dq_buffer_order_is_undone_by_ws_dq_finish(d, n_q):
    """`ws_dq_finish` (its Triton kernel) reads a dQ buffer laid out as the Gluon backward writes it (built here
    from the documented element positions: every query tile's 64-column blocks as the accumulators hold them, then
    at d = 80 / 96 all tails row-major), scaled into dQ's own layout: whole tiles into a non-dense dQ, and a ragged
    last tile (the buffer padded to whole tiles)."""
    from core.kernels.flash_triton import hopper
    z, h = 2, 3
    blocks = d // 64
    ref = torch.randn(z, h, n_q, d, dtype=torch.float64)
    acc = hopper.ws_dq_buffer(torch.empty(z, h, n_q, d))
    tiles = acc.shape[2] // 64
    assert acc.shape == (z, h, tiles * 64, d) and acc.dtype == torch.float32
    main = acc.view(-1)[:z * h * tiles * 64 * 64 * blocks].view(z, h, tiles, blocks, 64 * 64)
    rows, cols = torch.meshgrid(torch.arange(n_q), torch.arange(64 * blocks), indexing="ij")
    block, pos = _frag_position(rows % 64, cols)
    main[:, :, rows // 64, block, pos] = ref[..., :64 * blocks].float()
    if d % 64:
        tail = acc.view(-1)[z * h * tiles * 64 * 64 * blocks:].view(z, h, tiles * 64, d % 64)
        tail[:, :, :n_q] = ref[..., 64 * blocks:].float()
    dq = torch.empty(z, n_q, h, d, dtype=torch.bfloat16).transpose(1, 2)  # (B, T, H, d) viewed (B, H, T, d)
    hopper.ws_dq_finish(acc, dq, 0.125)
    assert torch.allclose(dq.double(), 0.125 * ref, rtol=1e-2, atol=1e-2)


def test_ws_dq_shared_layout_is_the_accumulator_order():
    """The Gluon backward's shared-memory layout of a d = 128 dQ block (`hopper._DQ_FRAG`, given by its offset
    bits' bases) puts each element where the TMA box of 128-byte-swizzled rows reads it for `_frag_position`:
    float o = 32 t + 4 (j ^ t % 8) + 2 h + e."""
    from core.kernels.flash_triton import hopper
    if not hopper.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    bases = hopper._DQ_FRAG.value.offset_bases
    assert len(bases) == 12
    for o in range(64 * 64):
        row = col = 0
        for bit, (r, c) in enumerate(bases):
            if o >> bit & 1:
                row, col = row ^ r, col ^ c
        half, pos = _frag_position(torch.tensor(row), torch.tensor(col))
        t, p = divmod(int(pos), 32)
        assert half == 0 and o == 32 * t + 4 * (p // 4 ^ t % 8) + p % 4, (o, row, col)


def _pretend_compiled_hopper(monkeypatch) -> None:
    """Make the Gluon kernels' host checks see compiled CUDA (no interpreter) on an sm_90 device."""
    monkeypatch.setattr(ftc, "INTERPRET", False)
    monkeypatch.setattr(ftl, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.Tensor, "device", property(lambda t: torch.device("cuda", 0)))


def test_gluon_ws_only_where_it_applies(monkeypatch):
    """The warp-specialised backward is on by default (`hopper_ws`), and does not run for fp32, other head dims,
    odd N_q, unaligned rows, other GPUs or under the interpreter."""
    from core.kernels.flash_triton import hopper
    if not hopper.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    x = torch.zeros(1, 1, 64, 64, dtype=torch.bfloat16)
    _pretend_compiled_hopper(monkeypatch)
    assert ftd._ws_ok(x, x, 64) and not ftd._ws_ok(x, x, 64, FlashConfig(hopper_ws=False))
    assert not ftd._ws_ok(x.float(), x.float(), 64)
    assert not ftd._ws_ok(x[..., :32], x[..., :32], 32)
    wide = torch.zeros(1, 1, 64, 128, dtype=torch.bfloat16)
    assert ftd._ws_ok(wide, wide, 128) and ftd._ws_ok(wide[..., :96], wide[..., :96], 96)  # 96: 64 + a tail
    assert ftd._ws_ok(wide[..., :80], wide[..., :80], 80) and not ftd._ws_ok(wide[..., :112], wide[..., :112], 112)
    assert not ftd._ws_ok(x[:, :, :63], x[:, :, :63], 64)  # odd N_q
    off = torch.zeros(62 * 64 + 4, dtype=torch.bfloat16)[4:].view(1, 1, 62, 64)  # 8 bytes off 16
    assert not ftd._ws_ok(off, x[:, :, :62], 64) and ftd._ws_ok(x[:, :, :62], x[:, :, :62], 64)
    monkeypatch.setattr(ftl, "_capability", lambda device: (10, 0))
    assert not ftd._ws_ok(x, x, 64)
    monkeypatch.setattr(ftl, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(ftc, "INTERPRET", True)
    assert not ftd._ws_ok(x, x, 64)


def test_default_backward_policy(monkeypatch):
    """"auto": fused on small grids, the warp-specialised backward from `ws_min_rows` rows (half as many without the
    causal mask), by head dim, where it applies (but not under torch.use_deterministic_algorithms), else two passes;
    another `backward` pins its variant."""
    monkeypatch.setattr(ftd, "_ws_ok", lambda q, do, d, cfg: cfg.hopper_ws)
    by_d = dict(FlashConfig().ws_min_rows)
    assert set(by_d) == {64, 80, 96, 128}  # every head dim the Gluon backward takes has a threshold
    for d, rows in by_d.items():
        # 8 x 16 heads: grids too large for the fused backward, down to a quarter of the rows
        at, below = (torch.empty(8, 16, n, d, dtype=torch.bfloat16) for n in (rows, rows // 2))
        assert ftd._default_bwd(at, at, at, True) == ft.BWD_ATOMIC_DQ, d
        assert ftd._default_bwd(below, below, below, True) == ft.BWD_TWO_PASS, d
        half = FlashConfig(ws_min_rows={d: rows // 2})
        assert ftd._default_bwd(below, below, below, True, half) == ft.BWD_ATOMIC_DQ
        assert ftd._default_bwd(at, at, at, True, FlashConfig(ws_min_rows={d: 2 * rows})) == ft.BWD_TWO_PASS
        # a head dim the mapping does not name never takes it; one number applies to every head dim
        assert ftd._default_bwd(at, at, at, True, FlashConfig(ws_min_rows={d + 1: 0})) == ft.BWD_TWO_PASS
        assert ftd._default_bwd(below, below, below, True, FlashConfig(ws_min_rows=0)) == ft.BWD_ATOMIC_DQ
        # without the mask half as many rows: a row sees every key, twice a causal row's on average
        quarter = torch.empty(8, 16, rows // 4, d, dtype=torch.bfloat16)
        assert ftd._default_bwd(below, below, below, False) == ft.BWD_ATOMIC_DQ, d
        assert ftd._default_bwd(quarter, quarter, quarter, False) == ft.BWD_TWO_PASS, d
    long = torch.empty(4, 16, by_d[64], 64, dtype=torch.bfloat16)
    short = torch.empty(4, 16, by_d[64] // 2, 64, dtype=torch.bfloat16)
    small = torch.empty(1, 1, 256, 64, dtype=torch.bfloat16)
    assert ftd._default_bwd(small, small, small, True) == ft.BWD_FUSED
    assert ftd._default_bwd(long, long, long, True, FlashConfig(hopper_ws=False)) == ft.BWD_TWO_PASS
    for name, code in (("two_pass", ft.BWD_TWO_PASS), ("atomic_dq", ft.BWD_ATOMIC_DQ), ("fused", ft.BWD_FUSED)):
        for x in (long, short, small):
            assert ftd._default_bwd(x, x, x, True, FlashConfig(backward=name)) == code
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert ftd._default_bwd(long, long, long, True) == ft.BWD_TWO_PASS
    # grouped-query attention in the Gluon backward: a program per KV head (walking its 4 query heads) below
    # ws_gqa_max_rows query rows under the mask, half as many without it
    cfg = FlashConfig()
    assert cfg.ws_gqa_max_rows == 32768
    # both thresholds count causal rows: a row without the mask counts twice, so an odd threshold rounds up
    assert FlashConfig(ws_min_rows=5).takes_ws(64, 3, False) and not FlashConfig(ws_min_rows=5).takes_ws(64, 2, False)
    assert FlashConfig(ws_gqa_max_rows=5).ws_gqa_heads(4, 2, False) == 4
    assert FlashConfig(ws_gqa_max_rows=5).ws_gqa_heads(4, 3, False) == 1
    assert cfg.ws_gqa_heads(4, 16384, True) == 4 and cfg.ws_gqa_heads(4, 32768, True) == 1
    assert cfg.ws_gqa_heads(4, 8192, False) == 4 and cfg.ws_gqa_heads(4, 16384, False) == 1
    assert FlashConfig(ws_gqa_max_rows=0).ws_gqa_heads(4, 512, True) == 1


def _gluon_usable() -> bool:
    from core.kernels.flash_triton import hopper
    return CUDA and hopper.HAVE_GLUON and torch.cuda.get_device_capability() == (9, 0)


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape_q,n_k,causal,dtype", [
    ((2, 3, 258, 64), 258, True, torch.bfloat16),
    ((1, 2, 200, 64), 333, True, torch.bfloat16),   # N_k not a multiple of the 128 keys of a ws program
    ((1, 2, 334, 64), 200, True, torch.bfloat16),   # rows that see no key
    ((2, 2, 1000, 64), 1000, False, torch.float16),
    ((2, 3, 257, 64), 257, True, torch.bfloat16),   # odd N_q: falls back to the Triton kernels
    ((2, 2, 512, 64), 512, True, torch.bfloat16),    # whole 64-row tiles: the dQ buffer unpadded
    ((2, 2, 512, 64), 512, False, torch.float16),    # ... and written into a non-dense dQ
    ((2, 3, 258, 128), 258, True, torch.bfloat16),  # head dim 128: K, V in shared memory, dQ split by head dim
    ((1, 2, 200, 128), 333, True, torch.bfloat16),
    ((1, 2, 334, 128), 200, True, torch.float16),
    ((2, 2, 1000, 128), 1000, False, torch.bfloat16),
    ((2, 2, 512, 128), 512, True, torch.bfloat16),   # whole 64-row tiles: the dQ buffer unpadded
    ((2, 2, 512, 128), 512, False, torch.float16),   # ... and written into a non-dense dQ
    ((2, 3, 258, 96), 258, True, torch.bfloat16),   # head dims 96 and 80: a 64-wide main part and a tail
    ((1, 2, 334, 96), 200, True, torch.float16),
    ((2, 2, 1000, 80), 1000, False, torch.bfloat16),
    ((1, 2, 200, 80), 333, True, torch.bfloat16),
])
def test_gpu_gluon_ws_matches(shape_q, n_k, causal, dtype):
    """The warp-specialised one-pass backward (`backward: atomic_dq` on Hopper): gradients against float64, and
    dK / dV against the Triton two-pass backward's."""
    if not _gluon_usable():
        pytest.skip("needs an sm_90 GPU and a Triton with Gluon")
    torch.manual_seed(12)
    q, k, v = make_qkv(shape_q, n_k, dtype, noncontig=shape_q[0] == 2 and not causal)
    assert ftd._ws_ok(q.detach(), q.detach(), shape_q[-1]) == (shape_q[2] % 2 == 0)
    check_against_reference(triton_with(ATOMIC_DQ), q, k, v, causal, TOL[dtype])
    out = FlashAttentionTriton.apply(q, k, v, causal, ATOMIC_DQ)
    do = torch.randn_like(out)
    gk, gv = torch.autograd.grad(out, (k, v), do)
    rk, rv = torch.autograd.grad(FlashAttentionTriton.apply(q, k, v, causal, TWO_PASS), (k, v), do)
    for a, b in ((gk, rk), (gv, rv)):
        assert torch.allclose(a.float(), b.float(), atol=1e-2, rtol=1e-2)


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 80, 96, 128])
@pytest.mark.parametrize("n_q,n_k,causal", [(334, 334, True), (200, 333, True), (334, 200, True), (516, 515, False)])
def test_gpu_gluon_ws_walks_a_kv_heads_query_heads(d, n_q, n_k, causal, monkeypatch):
    """Grouped-query attention (4 query heads per KV head) in the Gluon backward, a program per KV head and key
    block walking the group's query heads one after the other (the default below `ws_gqa_max_rows`; dK and dV
    added up in its accumulators and stored once per KV head), and a program per query head (`ws_gqa_max_rows: 0`;
    dK, dV summed on the host): gradients against float64 over k, v repeated per query head, with ragged ends,
    N_q != N_k and rows that see no key."""
    from core.kernels.flash_triton import hopper
    if not _gluon_usable():
        pytest.skip("needs an sm_90 GPU and a Triton with Gluon")
    heads = []
    launch_ws = hopper.launch_ws
    monkeypatch.setattr(hopper, "launch_ws", lambda *a, **kw: heads.append(a[-1] if len(a) > 14 else 1)
                        or launch_ws(*a, **kw))
    for cfg, walked in ((ATOMIC_DQ, 4), (ATOMIC_DQ.replace(ws_gqa_max_rows=0), 1)):
        torch.manual_seed(21)
        check_gqa_against_reference(cfg, 2, 8, 2, n_q, n_k, d, torch.bfloat16, causal)
        assert heads[-1] == walked


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 80, 96])
@pytest.mark.parametrize("views", [(True, True, True), (False, True, False), (True, False, True)],
                         ids=["views_qkv", "views_k", "views_qv"])
def test_gpu_gluon_ws_on_fused_projection_views(views, d):
    """The Gluon backward addresses dK / dV with K's / V's strides through TMA descriptors: with q, k, v as
    views of the fused projection (row strides of 3 H d), gradients against float64 (at d = 80 / 96 the tails'
    descriptors and loads stop at the head's last column, not reading the next head's)."""
    if not _gluon_usable():
        pytest.skip("needs an sm_90 GPU and a Triton with Gluon")
    torch.manual_seed(14)
    q, k, v = fused_qkv_views(2, 258, 3, 3, d, torch.bfloat16, views)
    check_against_reference(triton_with(ATOMIC_DQ), q, k, v, True, TOL[torch.bfloat16])


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_default_backward_is_ws_for_long_rows():
    """At `ws_min_rows` rows the default config runs the warp-specialised backward; its gradients agree with the
    two-pass backward's (float64 is too large here)."""
    if not _gluon_usable():
        pytest.skip("needs an sm_90 GPU and a Triton with Gluon")
    torch.manual_seed(13)
    # 2 x 8 heads: a grid too large for the fused backward
    q, k, v = (torch.randn(2, 8, FlashConfig().ws_rows(64), 64, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    do = torch.randn_like(q)
    assert ftd._default_bwd(q, k, do, True) == ft.BWD_ATOMIC_DQ
    o, lse = ft.flash_fwd_impl(q, k, v, True)
    got = ft.flash_bwd_impl(do, q, k, v, o, lse, True, ft.BWD_ATOMIC_DQ)
    ref = ft.flash_bwd_impl(do, q, k, v, o, lse, True, ft.BWD_TWO_PASS)
    for a, b in zip(got, ref):
        assert torch.isfinite(a).all()
        assert ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() < 1e-2


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_split_forward_counts_on_streams_and_in_graphs():
    """The one-launch split-KV forward shares per-stream arrival counts between launches: launches racing on two
    streams and CUDA graphs replayed on two streams at once all give the serial results bit for bit, and every
    count is back at 0 afterwards."""
    torch.manual_seed(3)
    shapes = [(1024, 128), (1024, 64), (2048, 64)]  # the short (32-row, one loop) and the 64-row split forward
    inputs = [[torch.randn(1, 1, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
              for n, d in shapes for _ in range(2)]
    with torch.no_grad():
        expected = [ft.flash_fwd_impl(q, k, v, True)[0] for q, k, v in inputs]
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        results: list[list] = [[], []]
        torch.cuda.synchronize()
        for rep in range(20):
            for j, stream in enumerate(streams):
                with torch.cuda.stream(stream):
                    for i in range(j, len(inputs), 2):
                        q, k, v = inputs[i]
                        out = FlashAttentionTriton.apply(q, k, v, True) if rep % 2 \
                            else ft.flash_fwd_impl(q, k, v, True)[0]
                        results[j].append((i, out))
        torch.cuda.synchronize()
        for j in range(2):
            for i, out in results[j]:
                assert torch.equal(out, expected[i]), (j, i)
        # graphs: each capture has counts of its own, so two graphs of one shape can replay side by side
        graphs, outs = [], []
        side = torch.cuda.Stream()
        for q, k, v in inputs[:2]:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                FlashAttentionTriton.apply(q, k, v, True)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs.append(FlashAttentionTriton.apply(q, k, v, True))
            graphs.append(graph)
        torch.cuda.synchronize()
        for rep in range(20):
            for graph, stream in zip(graphs, streams):
                with torch.cuda.stream(stream):
                    graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[0], expected[0]) and torch.equal(outs[1], expected[1])
        inputs[0][0].copy_(inputs[1][0])  # new data in a captured input: the replay follows
        graphs[0].replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[0], ft.flash_fwd_impl(*inputs[0], True)[0])
    assert all(not c.any() for c in ftl._ARRIVALS._by_stream.values())


# ------------------------------------------------------------------ the configuration
def test_config_yaml_is_the_default_config():
    """conf/attention_impl/flash_triton.yaml's `config:` block builds the default FlashConfig (the measured policy),
    and the plugin hands it to every call; a changed key reaches the kernels' choices."""
    pytest.importorskip("hydra")
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from tests.utils import CONF
    node = OmegaConf.load(CONF / "attention_impl" / "flash_triton.yaml")
    attn = instantiate(node)
    assert attn.config == FlashConfig() and attn.config.key == "" and attn.name == "flash_triton"
    node.config.backward = "two_pass"
    node.config.tiles = {"fused": [64, 64, 4, 3], "fwd": [128, 64, 8, 3, 168]}
    cfg = instantiate(node).config
    assert cfg.backward == "two_pass" and cfg.tile("fwd") == (128, 64, 8, 3, 168) and cfg.tile("dq") is None
    assert FlashConfig.from_key(cfg.key) == cfg and hash(cfg) == hash(FlashConfig.from_key(cfg.key))
    node.config.ws_min_rows = {64: 512, 128: 0}  # by head dim, through the key (JSON names them as strings)
    cfg = instantiate(node).config
    assert cfg.ws_rows(64) == 512 and cfg.ws_rows(128) == 0 and cfg.ws_rows(96) is None
    assert FlashConfig.from_key(cfg.key) == cfg
    assert FlashConfig().with_overrides("ws_min_rows=64:512/128:0") == FlashConfig(ws_min_rows={128: 0, 64: 512})
    assert FlashConfig().with_overrides("ws_min_rows=0").ws_rows(80) == 0
    assert FlashConfig().with_overrides("ws_min_rows={64:512}") == FlashConfig(ws_min_rows={64: 512})
    for spec, key in (("ws_min_rows=64-512", "ws_min_rows"), ("max_splits=abc", "max_splits"),
                      ("fwd=64x6x", "tiles.fwd"), ("split_keys=x", "split_keys")):
        with pytest.raises(ConfigError, match=f"attention_impl.config.{key}: .* does not parse"):
            FlashConfig().with_overrides(spec)


@needs_triton
def test_plugin_passes_its_config(monkeypatch):
    """KernelAttention(config=...) calls the Function with the config: backward=two_pass launches the two passes
    where the default would fuse."""
    pytest.importorskip("hydra")  # core.attention builds plugins with hydra
    from core.attention import KernelAttention
    launched = []
    real_launch = ftd._launch
    monkeypatch.setattr(ftd, "_launch", lambda name, *a, **kw: launched.append(name) or real_launch(name, *a, **kw))
    q, k, v = make_qkv((1, 2, 20, 16), 20, torch.float32)
    for cfg, expected in ((None, ["fwd", "fused"]), (TWO_PASS, ["fwd", "dq", "dkdv"])):
        launched.clear()
        attn = KernelAttention("core.kernels.flash_triton.FlashAttentionTriton", config=cfg)
        attn(q, k, v, is_causal=True).sum().backward()
        assert launched == expected


@pytest.mark.parametrize("kwargs,key", [
    (dict(backward="split"), "attention_impl.config.backward"),
    (dict(split_merge="later"), "attention_impl.config.split_merge"),
    (dict(tiles={"bwd": (64, 64, 4, 3)}), "attention_impl.config.tiles"),
    (dict(tiles={"fwd": (64, 48, 4, 3)}), "attention_impl.config.tiles.fwd"),
    (dict(tiles={"fwd": (64, 64)}), "attention_impl.config.tiles.fwd"),
    (dict(max_splits=1), "attention_impl.config.max_splits"),
    (dict(split_keys=0), "attention_impl.config.split_keys"),
    (dict(ws_min_rows=-1), "attention_impl.config.ws_min_rows"),
    (dict(ws_min_rows={64: -1}), "attention_impl.config.ws_min_rows"),
    (dict(ws_min_rows={"sixty-four": 2048}), "attention_impl.config.ws_min_rows"),
    (dict(ws_min_rows="2048"), "attention_impl.config.ws_min_rows"),
])
def test_config_refuses_bad_values(kwargs, key):
    with pytest.raises(ConfigError) as err:
        FlashConfig(**kwargs)
    assert err.value.key == key


def test_config_overrides():
    cfg = FlashConfig().with_overrides("backward=fused,hopper_ws=0,split_keys=64,fwd=64x32x4x2,dkdv=64x64x4x3x168")
    assert cfg == FlashConfig(backward="fused", hopper_ws=False, split_keys=64,
                              tiles={"fwd": (64, 32, 4, 2), "dkdv": (64, 64, 4, 3, 168)})
    assert cfg.with_overrides("split_keys=none").split_keys is None
    with pytest.raises(ConfigError, match="unknown override"):
        FlashConfig().with_overrides("native=0")


# ------------------------------------------------------------------ the warp-specialised Gluon forward (Hopper)
_GLUON_FWD_COMPILE = """
import torch
from triton.runtime.jit import mangle_type
from core.kernels.flash_triton import common, hopper, hopper_forward as hf
# compiled: a kernel for each value of every compile-time choice (tail width, key tile, consumers, turns, first
# tile's placement, swapped halves, polynomial exponentials, split rings, O buffers, mask, producer warps, Q
# buffers), and the three-consumer kernels of both tile widths; the policy is checked on every tile set
COMPILED = {(64, True, "FWD"), (80, False, "WIDE"), (128, False, "FWD"), (96, True, "SHORT"), (96, True, "WIDE"),
            (64, False, "WIDE")}
CHOICES = ("D_TAIL", "BLOCK_N", "NUM_CONS", "PINGPONG", "PEEL", "SWAP", "EXP_POLY", "O_OWN", "IS_CAUSAL",
           "PRODUCER_WARPS", "Q_BUFS")
every, covered = set(), set()
turns = 0
firsts = []
for d in hf.HEAD_DIMS:
    d_main, d_tail = common._TILE_D[d]
    for causal, name in ((True, "FWD"), (False, "FWD"), (True, "SHORT"), (True, "WIDE"), (False, "WIDE")):
        tiles = getattr(hf, name + "_TILES")
        if d not in tiles:
            continue
        block_n, stages, q_bufs, consumers = tiles[d][:4]
        constexprs = hf.fwd_constexprs(d, causal, tiles[d])  # what `launch_fwd` compiles
        # ping-pong: each consumer waits for its turn and hands it over around every group of matmuls it issues
        turns += constexprs["PINGPONG"]
        firsts.append(constexprs["PEEL"])
        assert constexprs["EXP_POLY"] == (d == 64 and block_n == 128 and consumers == 2), (d, tiles[d])
        values = {(c, constexprs[c]) for c in CHOICES} | {("split rings", constexprs["K_STAGES"] != stages)}
        every |= values
        if (d, causal, name) not in COMPILED:
            continue
        covered |= values
        types = {"LSE": "*fp32"}
        for arg in ("Q", "K", "V", "O", "Q_T", "K_T", "V_T", "O_T"):  # 4-D TMA descriptors made on the host
            if arg.endswith("_T") and not d_tail:  # no tail: None, a constexpr (`launch_fwd`)
                constexprs[arg] = None
                continue
            rows = hf.HALF_M if arg[0] in "QO" else block_n
            width = d_tail if arg.endswith("_T") and d_tail else d_main
            types[arg] = mangle_type(hopper.tma_desc(torch.empty(1, 1, rows, width, dtype=torch.bfloat16),
                                                      (1, 1, rows, width)))
        kernel = compile_sm90(hf._fwd_ws_kernel, constexprs, types)
        ptx = kernel.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and kernel.asm["cubin"]
        # O leaves through shared memory by TMA: a store per head-dim part in each consumer's code
        assert ptx.count("cp.async.bulk.tensor.4d.global.shared") == consumers * (2 if d_tail else 1), d
        # the head dim's tail: its own wgmmas (N = the tail's width for O += P V)
        assert (f"m64n{d_tail}k16" in ptx) == bool(d_tail), d
        # d = 64's two consumers over 128-key tiles: an eighth of the exponentials by polynomial (its rounding
        # constant 1.5 * 2^23)
        assert ("0f4B400000" in ptx) == constexprs["EXP_POLY"], (d, tiles[d])
        # consumer warpgroups and a producer warpgroup, registers moved between them; within shared memory
        assert "setmaxnreg" in ptx and kernel.metadata.num_warps == 4 * (consumers + 1), d
        assert kernel.metadata.shared <= hf.SMEM_LIMIT, d
        # a consumer's copies of S = Q K^T (d / 16 wgmmas) and O += P V (BLOCK_N / 16 a head-dim part): with the
        # first key tile in the loop, one S and two PVs (the loop's, the last tile's); peeled off, two S (the peeled
        # tile's, the loop's) and two PVs; peeled, with loops over full and over masked tiles, three of each
        s_copies, pv_copies = {hf.IN_LOOP: (1, 2), hf.PEEL_ONE_LOOP: (2, 2), hf.PEEL_TWO_LOOPS: (3, 3)}[
            constexprs["PEEL"]]
        per_consumer = s_copies * d // 16 + pv_copies * (block_n // 16) * (2 if d_tail else 1)
        assert ptx.count("wgmma.mma_async") == consumers * per_consumer, (d, causal, tiles[d])
assert covered == every, every - covered  # the compiled kernels take every value of every choice
assert turns == 6, turns  # the 128-key tiles at d = 80, 96 and 128, causal and not
# in the loop: d = 64's 128-key tiles (two and three consumers, causal and not: 4) and the 128-key tiles under the
# mask at d = 80-128 (3); peeled, one loop: the 64-key short-row tiles (4 head dims) and the 128-key tiles without the
# mask at d = 80-128 (3); peeled, two loops: three consumers over 64-key tiles (d = 80 and 96, causal and not)
assert [firsts.count(f) for f in (hf.IN_LOOP, hf.PEEL_ONE_LOOP, hf.PEEL_TWO_LOOPS)] == [7, 7, 4], firsts
print("compiled")
"""


@pytest.mark.slow  # cold (a CI machine's empty Triton cache): 30-45 s
def test_gluon_fwd_compiles_for_sm90():
    """The warp-specialised Gluon forward compiles for sm_90a with the installed Triton, no GPU needed: six of the
    18 kernels the dispatch launches (d = 64, 80, 96, 128, causal and not, the short-row 64-key tiles, three
    consumers), which between them take every value of every compile-time choice (the GPU tests run all 18; each
    cold compile is some 6 s of CI time)."""
    from core.kernels.flash_triton import hopper_forward
    if not hopper_forward.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    compile_in_child(_GLUON_FWD_COMPILE)


def test_gluon_fwd_tail_heads():
    """The causal schedule's tail (`tail_heads`): the fewest last heads such that the units (two query tiles) of the
    heads before fill whole rounds of the grid and the tail's tiles make two rounds or more, while its heads' K and
    V fit in half the L2; else none. At (32, 16, 2048, 64) on 132 SMs, 16 tiles a head: the units of 495 heads make
    30 rounds, and 17 heads' 272 tiles end the walk, where units alone leave 4 units' 8 tiles over 132 programs."""
    from core.kernels.flash_triton import hopper_forward as hf
    l2 = 50 << 20
    assert hf.tail_heads(512, 16, 132, 4 * 2048 * 64, l2) == 17
    assert hf.tail_heads(512, 16, 132, 4 * 2048 * 64, 16 << 20) == 0  # 17 heads' K and V (8.9 MB) over half
    assert hf.tail_heads(8, 16, 64, 1, l2) == 8  # two rounds of 64 programs need every head
    assert hf.tail_heads(3, 3, 8, 1, l2) == 0  # 9 tiles: under two rounds of 8 programs
    for n_zh, n_tiles, grid in itertools.product((1, 7, 64, 120, 512, 2048), (1, 3, 5, 16, 43, 86), (7, 114, 132)):
        fits = [tail for tail in range(1, n_zh + 1)  # by search: units of the heads before in whole rounds, ...
                if (n_zh - tail) * n_tiles % (2 * grid) == 0 and tail * n_tiles >= 2 * grid]
        assert hf.tail_heads(n_zh, n_tiles, grid, 1, l2) == (fits[0] if fits else 0), (n_zh, n_tiles, grid)
        if fits and n_tiles % 2:
            assert (n_zh - fits[0]) % 2 == 0  # two heads' middle tiles make a unit


def test_gluon_fwd_only_where_it_applies(monkeypatch):
    """The Gluon forward is on by default (`hopper_fwd`) for bf16 / fp16 at head dims 64, 80, 96 and 128 with
    TMA-aligned q, k, v, and off for fp32, other head dims, unaligned rows, other GPUs and under the interpreter."""
    from core.kernels.flash_triton import hopper_forward
    if not hopper_forward.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    x = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    _pretend_compiled_hopper(monkeypatch)
    assert ftd._hopper_fwd_ok(x, x, x, FlashConfig())
    assert not ftd._hopper_fwd_ok(x, x, x, FlashConfig(hopper_fwd=False))
    assert ftd._hopper_fwd_ok(x.half(), x.half(), x.half(), FlashConfig())
    assert not ftd._hopper_fwd_ok(x.float(), x.float(), x.float(), FlashConfig())
    for d, applies in ((32, False), (64, True), (80, True), (96, True), (112, False)):
        y = x[..., :d].contiguous()
        assert ftd._hopper_fwd_ok(y, y, y, FlashConfig()) == applies, d
    sliced = x[..., :96]  # a view with 128-column rows: its tail's base is 128 bytes past each row's start
    assert ftd._hopper_fwd_ok(sliced, sliced, sliced, FlashConfig())
    kv = x[:, :1]  # grouped-query: one KV head for two query heads
    assert ftd._hopper_fwd_ok(x, kv, kv, FlashConfig())
    assert not ftd._hopper_fwd_ok(x, kv.expand_as(x), kv.expand_as(x), FlashConfig())  # stride 0: no descriptor
    off = torch.zeros(2 * 64 * 128 + 4, dtype=torch.bfloat16)[4:].view(1, 2, 64, 128)  # 8 bytes off 16
    assert not ftd._hopper_fwd_ok(off, x, x, FlashConfig())
    monkeypatch.setattr(ftl, "_capability", lambda device: (10, 0))
    assert not ftd._hopper_fwd_ok(x, x, x, FlashConfig())
    monkeypatch.setattr(ftl, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(ftc, "INTERPRET", True)
    assert not ftd._hopper_fwd_ok(x, x, x, FlashConfig())


def test_forward_policy_takes_gluon_where_it_applies(monkeypatch):
    """The forward runs the Gluon kernel where it applies (at every head dim it takes, 80 = 64 + 16 here; at 64 from
    `hopper_fwd_d64_min_rows` query rows on under a causal mask), with its short-row tiles below
    `hopper_fwd_long_rows` query rows under a causal mask (the 128-key tiles without it) and its three-consumer tiles
    from there on at d = 64 and 80 (32 has none: its 128-key tiles); at d = 64 under a causal mask the short-row tiles
    below `hopper_fwd_d64_short_rows` and three consumers from `hopper_fwd_d64_long_rows`, without the mask three
    from `hopper_fwd_d64_unmasked_long_rows`; unless the split-KV forward splits the call or `tiles.fwd` pins the
    Triton kernel; elsewhere the Triton kernels (their output against float64 here)."""
    from core.kernels.flash_triton import hopper_forward as hf
    launched = []

    def fake_launch(q, k, v, o, lse, is_causal, sm_scale, tiles=None, replay=False):
        d = q.shape[3]
        kind = {hf.SHORT_TILES[d]: "short", hf.FWD_TILES[d]: "fwd", hf.WIDE_TILES.get(d): "wide"}[tiles]
        launched.append((q.shape[2], kind))
        ref, ref_lse = reference_attention(q, k, v, is_causal)
        o.copy_(ref)
        lse.copy_(ref_lse)

    monkeypatch.setattr(ftd, "_hopper_fwd_ok", lambda q, k, v, cfg: cfg.hopper_fwd)
    monkeypatch.setattr(hf, "launch_fwd", fake_launch)
    monkeypatch.setattr(hf, "HEAD_DIMS", (32, 64, 80))
    monkeypatch.setattr(hf, "FWD_TILES", {32: (128, 6, 1, 2), 64: (128, 5, 2, 2), 80: (128, 4, 1, 2)})
    monkeypatch.setattr(hf, "SHORT_TILES", {32: (64, 8, 2, 2), 64: (64, 11, 2, 2), 80: (64, 8, 2, 2)})
    monkeypatch.setattr(hf, "WIDE_TILES", {64: (128, 5, 1, 3), 80: (64, 6, 1, 3)})
    cfg = FlashConfig(hopper_fwd_long_rows=64, hopper_fwd_d64_min_rows=64, hopper_fwd_d64_short_rows=96,
                      hopper_fwd_d64_long_rows=128, hopper_fwd_d64_unmasked_long_rows=64)
    cases = [(64, 32, cfg, [(64, "fwd")]), (32, 32, cfg, [(32, "short")]),  # long tiles from hopper_fwd_long_rows
             (64, 80, cfg, [(64, "wide")]), (32, 80, cfg, [(32, "short")]),  # 80 = 64 + 16: three consumers
             (32, 64, cfg, []), (64, 64, cfg, [(64, "short")]),  # d = 64: from hopper_fwd_d64_min_rows,
             (96, 64, cfg, [(96, "fwd")]),  # 128-key tiles from hopper_fwd_d64_short_rows,
             (128, 64, cfg, [(128, "wide")]),  # three consumers from hopper_fwd_d64_long_rows
             (64, 32, cfg.replace(split_keys=16), []),          # a split-KV call stays split
             (64, 32, cfg.replace(hopper_fwd=False), []),
             (64, 32, cfg.replace(tiles={"fwd": (32, 16, 4, 1)}), [])]  # pinned tiles: the Triton forward
    cases = [(n_q, d, c, expect, True) for n_q, d, c, expect in cases]
    cases += [(32, 32, cfg, [(32, "fwd")], False),  # no causal mask: the 128-key tiles at short rows too,
              (32, 64, cfg, [(32, "fwd")], False),  # at d = 64 at every row count,
              (64, 64, cfg, [(64, "wide")], False),  # with three consumers from hopper_fwd_d64_unmasked_long_rows,
              (64, 80, cfg.replace(hopper_fwd_long_rows=128), [(64, "fwd")], False)]  # else hopper_fwd_long_rows
    for n_q, d, c, expect, causal in cases:
        launched.clear()
        q, k, v = (torch.randn(1, 2, n_q, d, device=DEVICE) for _ in range(3))
        out, lse = ft.flash_fwd_impl(q, k, v, causal, c)
        assert launched == expect, (n_q, d, c, causal)
        ref, ref_lse = reference_attention(q, k, v, causal)
        assert rel_err(out, ref) < TOL[torch.float32] and rel_err(lse, ref_lse) < TOL[torch.float32]


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape_q,n_k,causal,dtype,kv_heads", [
    ((2, 3, 258, 128), 258, True, torch.bfloat16, 3),
    ((1, 2, 200, 128), 333, True, torch.bfloat16, 2),    # N_k not a multiple of the 128-key tiles
    ((1, 2, 334, 128), 200, True, torch.bfloat16, 2),    # rows that see no key: output 0, logsumexp -inf
    ((2, 2, 1000, 128), 1000, False, torch.float16, 2),
    ((2, 8, 300, 128), 300, True, torch.bfloat16, 2),    # grouped-query: 4 query heads per KV head
    ((2, 3, 258, 96), 258, True, torch.bfloat16, 3),     # d = 96 = 64 + 32: the head dim's tail in its own wgmmas
    ((1, 2, 334, 96), 200, True, torch.float16, 2),
    ((2, 8, 300, 96), 431, False, torch.bfloat16, 2),
    ((2, 3, 258, 80), 258, True, torch.bfloat16, 3),     # d = 80 = 64 + 16
    ((1, 4, 515, 80), 515, False, torch.float16, 1),
    # more pairs of query tiles than SMs: each persistent program walks several, through both Q buffers
    ((4, 16, 1000, 128), 1000, True, torch.bfloat16, 4),
    ((4, 16, 900, 96), 900, True, torch.float16, 16),
    ((2, 32, 640, 80), 640, False, torch.bfloat16, 8),   # five query tiles a head: two heads' middle ones a unit
    ((3, 5, 1152, 96), 1152, True, torch.bfloat16, 5),   # nine tiles a head, 15 heads: the last head's middle alone
    ((5, 15, 512, 96), 512, True, torch.float16, 5),     # 150 pairs: a round of pairs, then a tile a program
    ((2, 8, 1000, 64), 1000, True, torch.bfloat16, 2),   # d = 64 (by default only from hopper_fwd_d64_min_rows)
    ((4, 16, 515, 64), 515, False, torch.float16, 16),
    ((3, 15, 2000, 64), 2000, True, torch.bfloat16, 5),  # three consumers: 11 tiles of 192 rows, the last ragged
])
def test_gpu_gluon_fwd_matches(shape_q, n_k, causal, dtype, kv_heads, monkeypatch):
    """The warp-specialised Gluon forward (at d = 64 too: `hopper_fwd_d64_min_rows: 0`), with its short-row (64-key)
    tiles (these rows' default) and its 128-key tiles (`hopper_fwd_long_rows: 0`): output and logsumexp against
    float64, gradients through the backward that follows."""
    from core.kernels.flash_triton import hopper_forward
    if not (_gluon_usable() and hopper_forward.HAVE_GLUON):
        pytest.skip("needs an sm_90 GPU and a Triton with Gluon")
    launches = _count_gluon_forwards(monkeypatch)
    torch.manual_seed(15)
    b, h, n_q, d = shape_q
    q = torch.randn(b, h, n_q, d, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, kv_heads, n_k, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    kr, vr = (x.detach().double().repeat_interleave(h // kv_heads, dim=1) for x in (k, v))
    ref, ref_lse = reference_attention(q.detach().double(), kr, vr, causal)
    seen = torch.isfinite(ref_lse)
    gluon_anywhere = FlashConfig(hopper_fwd_d64_min_rows=0)
    for cfg in (gluon_anywhere, gluon_anywhere.replace(hopper_fwd_long_rows=0)):
        assert ftd._hopper_fwd_ok(q, k, v, cfg)
        out, lse = flash_attention_with_lse(q, k, v, causal, cfg)
        assert rel_err(out, ref) < TOL[dtype]
        assert torch.equal(torch.isfinite(lse), seen) and (lse[seen].double() - ref_lse[seen]).abs().max() < 1e-3
        check_gqa_against_reference(cfg, b, h, kv_heads, n_q, n_k, d, dtype, causal)
    assert launches == [1, 1, 1, 1]  # every forward ran the Gluon kernel


def _gluon_fwd_variants(d: int, n_q: int, n_k: int, causal: bool, seed: int, tiles: tuple[int, ...],
                        variants: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`launch_fwd` once per variant (its keyword arguments; `tiles` unless a variant names its own) on the same 120
    heads (programs walk several query tiles), outputs poisoned with NaN first; each output and logsumexp checked
    against float64 (rows that see no key: logsumexp -inf). Returns the (output, logsumexp) pairs."""
    from core.kernels.flash_triton import hopper_forward as hf
    if not (_gluon_usable() and hf.HAVE_GLUON):
        pytest.skip("needs an sm_90 GPU and a Triton with Gluon")
    torch.manual_seed(seed)
    q = torch.randn(3, 40, n_q, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(3, 40, n_k, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), causal)
    seen = torch.isfinite(ref_lse)
    outs = []
    for kwargs in variants:
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:3], float("nan"), device="cuda", dtype=torch.float32)
        hf.launch_fwd(q, k, v, out, lse, causal, d ** -0.5, **{"tiles": tiles, **kwargs})
        assert rel_err(out, ref) < TOL[torch.bfloat16], kwargs
        assert torch.equal(torch.isfinite(lse), seen) and (lse[seen].double() - ref_lse[seen]).abs().max() < 1e-3
        outs.append((out, lse))
    return outs


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("n_q,n_k,causal", [(600, 600, True), (334, 200, True), (200, 333, True),
                                            (700, 515, False)])
def test_gpu_gluon_fwd_turns_match(d, n_q, n_k, causal):
    """The Gluon forward's two consumers issuing their matmuls in turns (ping-pong, by default at d = 80, 96 and 128) or
    not, at every head-dim class: output and logsumexp against float64, with rows that see no key (n_q > n_k under
    the causal mask: the turns skip those tiles), ragged ends, and several query tiles a program."""
    from core.kernels.flash_triton import hopper_forward as hf
    _gluon_fwd_variants(d, n_q, n_k, causal, 17, hf.FWD_TILES[d], [dict(turns=True), dict(turns=False)])


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("tiles,d", [((128, 3, 1, 2), 128), ((64, 4, 2, 2), 128), ((128, 3, 2, 2), 96),
                                     ((64, 6, 1, 3), 80), ((128, 5, 1, 3), 64)])
@pytest.mark.parametrize("n_q,n_k,causal", [(600, 600, True), (334, 200, True), (700, 515, False)])
def test_gpu_gluon_fwd_split_rings_match(tiles, d, n_q, n_k, causal):
    """A K ring shallower than the V ring (tiles' fifth number; K slots go back after S = Q K^T, V slots after the
    PV matmul) computes the same sums as one ring of K and V: output and logsumexp bit for bit the same, with the
    turns, a head-dim tail, swapped halves and skipped key tiles (64-key tiles under the mask), three consumers,
    the first key tile peeled off the loop or in it, an O buffer of each consumer's own where the shallower ring
    leaves room for one; and against float64."""
    from core.kernels.flash_triton import hopper_forward as hf
    split = (*tiles, tiles[1] - 1)
    assert hf.fwd_constexprs(d, causal, split)["K_STAGES"] == tiles[1] - 1
    outs = _gluon_fwd_variants(d, n_q, n_k, causal, 19, tiles, [dict(), dict(tiles=split),
                                                                dict(tiles=split, first=hf.PEEL_TWO_LOOPS)])
    for out, lse in outs[1:]:
        assert torch.equal(outs[0][0], out) and torch.equal(outs[0][1], lse)


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("tiles,d", [("SHORT_TILES", 128), ("SHORT_TILES", 64), ("FWD_TILES", 96),
                                     ("WIDE_TILES", 64), ("WIDE_TILES", 80)])
@pytest.mark.parametrize("n_q,n_k,causal", [(600, 600, True), (334, 200, True), (700, 515, False)])
def test_gpu_gluon_fwd_first_tile_in_loop_matches_peel(tiles, d, n_q, n_k, causal):
    """A query tile's first key tile run in the loop (its PV adds P = 0 times its V tile: exactly zero), peeled off
    the loop with the others in one loop, and peeled with loops over full and masked tiles (`peel`) compute the same
    sums in the same order: output and logsumexp bit for bit the same, on two and three consumers, 64- and 128-key
    tiles, the turns, a head-dim tail, rows that see no key and ragged ends; and against float64."""
    from core.kernels.flash_triton import hopper_forward as hf
    outs = _gluon_fwd_variants(d, n_q, n_k, causal, 18, getattr(hf, tiles)[d],
                               [dict(first=f) for f in (hf.IN_LOOP, hf.PEEL_ONE_LOOP, hf.PEEL_TWO_LOOPS)])
    for out, lse in outs[1:]:
        assert torch.equal(outs[0][0], out) and torch.equal(outs[0][1], lse)


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("tiles,d", [("SHORT_TILES", 128), ("SHORT_TILES", 80), ((64, 8, 2, 2), 64)])
@pytest.mark.parametrize("n_q,n_k", [(600, 600), (334, 200), (200, 333), (1024, 1024)])
def test_gpu_gluon_fwd_swapped_halves_match(tiles, d, n_q, n_k):
    """Two consumers taking alternate halves of their query tiles under the causal mask, skipping the key tiles
    wholly masked for their rows (`swap_halves`), compute what they compute with fixed halves, every key tile
    run: a skipped tile would add exp2(-inf) = 0 and leave the max, so output and logsumexp are bit for bit the
    same; with ragged ends, rows that see no key, n_q < n_k, and against float64."""
    from core.kernels.flash_triton import hopper_forward as hf
    tiles = getattr(hf, tiles)[d] if isinstance(tiles, str) else tiles
    outs = _gluon_fwd_variants(d, n_q, n_k, True, 19, tiles, [dict(swap=True), dict(swap=False)])
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("tiles,d", [("FWD_TILES", 64), ("SHORT_TILES", 128), ("WIDE_TILES", 96)])
@pytest.mark.parametrize("n_q,n_k", [(600, 600), (334, 200), (200, 333)])
def test_gpu_gluon_fwd_tail_matches(tiles, d, n_q, n_k):
    """The schedule with a tail of heads dealt a query tile a program (`tail_heads`; here every head, and 1 or 7
    of them after units that end in a partial round) computes every tile once, as the units alone do: a tile's sums
    do not depend on the program that runs it, so output and logsumexp are bit for bit the same (NaN-poisoned
    outputs: a tile left out shows); with ragged ends, rows that see no key, and against float64."""
    from core.kernels.flash_triton import hopper_forward as hf
    outs = _gluon_fwd_variants(d, n_q, n_k, True, 22, getattr(hf, tiles)[d],
                               [dict(tail=0), dict(tail=1), dict(tail=7), dict(tail=120)])
    for out, lse in outs[1:]:
        assert torch.equal(outs[0][0], out) and torch.equal(outs[0][1], lse)


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("tiles", ["SHORT_TILES", "FWD_TILES"])
@pytest.mark.parametrize("n_q,n_k,causal", [(600, 600, True), (334, 200, True), (200, 333, True),
                                            (700, 515, False)])
def test_gpu_gluon_fwd_polynomial_exponentials(tiles, n_q, n_k, causal):
    """An eighth of the exponentials by polynomial (`exp2_poly`: d = 64's two consumers over 128-key tiles; forced
    on over the 64-key ones too) against all by the special-function unit: both within tolerance of float64, rows
    that see no key (exp2(-inf) exactly 0) included, and within bf16 rounding of each other."""
    from core.kernels.flash_triton import hopper_forward as hf
    outs = _gluon_fwd_variants(64, n_q, n_k, causal, 21, getattr(hf, tiles)[64],
                               [dict(exp_poly=True), dict(exp_poly=False)])
    assert rel_err(outs[0][0], outs[1][0]) < 4e-3
    seen = torch.isfinite(outs[1][1])
    assert (outs[0][1][seen] - outs[1][1][seen]).abs().max() < 1e-3


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [80, 128])
def test_gpu_gluon_fwd_on_fused_projection_views(d, monkeypatch):
    """The Gluon forward reads q, k, v sliced from the fused projection in place (4-D TMA descriptors at their
    strides; at d = 80 the head dim's tail through descriptors of its own) and writes O dense in the model's
    (B, T, H, d) order."""
    from core.kernels.flash_triton import hopper_forward
    if not (_gluon_usable() and hopper_forward.HAVE_GLUON):
        pytest.skip("needs an sm_90 GPU and a Triton with Gluon")
    launches = _count_gluon_forwards(monkeypatch)
    torch.manual_seed(16)
    q, k, v = fused_qkv_views(2, 2048, 4, 4, d, torch.bfloat16, (True, True, True))
    check_against_reference(triton_with(FlashConfig()), q, k, v, True, TOL[torch.bfloat16])  # 2048 rows: Gluon
    assert launches == [1]


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("d,views", [(64, (True, True, True)), (80, (True, True, True)), (128, (False, True, False))])
def test_gpu_gluon_fwd_replays_per_geometry(d, views, monkeypatch):
    """From the third forward of one geometry (the first compiles, the second launches directly and is kept)
    flash_fwd_impl replays the Gluon launch without its policy: every call, on new tensors each time (new
    addresses), matches float64; a call of that geometry whose q is not 16-byte aligned takes the policy path (and
    the Triton forward) and is right too, as is one with a profiler's launch hook set."""
    from core.kernels.flash_triton import hopper_forward
    if not (_gluon_usable() and hopper_forward.HAVE_GLUON):
        pytest.skip("needs an sm_90 GPU and a Triton with Gluon")
    monkeypatch.setattr(ftd, "_FWD_REPLAYS", {})
    monkeypatch.setattr(ftl, "_LAUNCHERS", {})  # the first call then goes through JITFunction.run
    policy = _count_calls(monkeypatch, ftd, "_check_runtime")  # the policy path's first step
    torch.manual_seed(17)

    def forward_matches(q, k, v):
        out, lse = ftd.flash_fwd_impl(q, k, v, True)
        ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), True)
        assert out.stride() == ftd._dense_layout(q).stride()
        assert rel_err(out, ref) < TOL[torch.bfloat16] and (lse.double() - ref_lse).abs().max() < 1e-3

    for _ in range(4):
        q, k, v = (x.detach() for x in fused_qkv_views(2, 2048, 4, 4, d, torch.bfloat16, views))
        forward_matches(q, k, v)
    assert len(policy) == 2 and len(ftd._FWD_REPLAYS) == 1
    # q at the same shape and strides, 8 bytes off alignment: the policy path
    span = sum((n - 1) * st for n, st in zip(q.shape, q.stride())) + 1
    buf = torch.randn(span + 4, device="cuda", dtype=torch.bfloat16)
    forward_matches(torch.as_strided(buf, q.shape, q.stride(), 4), k, v)
    assert len(policy) == 3
    forward_matches(*(x.detach() for x in fused_qkv_views(2, 2048, 4, 4, d, torch.bfloat16, views)))
    assert len(policy) == 3
    import triton
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda metadata: None)
    forward_matches(*(x.detach() for x in fused_qkv_views(2, 2048, 4, 4, d, torch.bfloat16, views)))
    assert len(policy) == 4


def _count_gluon_forwards(monkeypatch) -> list[int]:
    """Count the Gluon forwards a test runs: `launch_fwd` calls and their replays (`FwdReplay`, a geometry's later
    calls, maybe one an earlier test in this process made)."""
    from core.kernels.flash_triton import hopper_forward
    calls = _count_calls(monkeypatch, hopper_forward, "launch_fwd")
    replay = hopper_forward.FwdReplay.__call__

    def counted(self, *args):
        calls.append(1)
        return replay(self, *args)
    monkeypatch.setattr(hopper_forward.FwdReplay, "__call__", counted)
    return calls


def _count_calls(monkeypatch, module, name: str) -> list[int]:
    """Wrap module.name so each call appends 1 to the returned list (which kernels a test ran)."""
    calls, fn = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    monkeypatch.setattr(module, name, counted)
    return calls


def test_hopper_kernels_bench_refuses_in_one_line(capsys):
    """experiments/flash_hopper_kernels.py: a malformed --shapes, or a machine without an sm_90 GPU, is one line on
    stderr and exit code 2, before any kernel runs."""
    from experiments import flash_hopper_kernels as bench
    assert bench.main(["--shapes", "4x16"]) == 2
    assert "--shapes" in capsys.readouterr().err
    if not (CUDA and torch.cuda.get_device_capability() == (9, 0)):
        assert bench.main([]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
