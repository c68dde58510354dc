"""flash_triton's C++ autograd node (core/kernels/flash_native.py, csrc/flash_node.cpp).

On the GPU: the node's outputs and gradients equal the Python autograd Function's bit for bit (the same kernels,
launched from a recorded plan), and a float64 reference within the dtype's bound, over signatures that exercise
every launch the plans replay (one-kernel and split-KV forward, fused and two-pass backward, odd lengths, N_q !=
N_k, the model's transposed layout, unaligned views, aliased inputs, expanded gradients). On the CPU: the extension
compiles against the installed torch, and the recorder refuses runs it could not replay.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from core.errors import ConfigError  # noqa: E402
from core.kernels import flash_native, flash_triton as ft  # noqa: E402
from core.kernels._flash_common import reference_attention  # noqa: E402
from core.kernels.flash_triton import FlashAttentionTriton  # noqa: E402

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not (CUDA and flash_native.available()),
                               reason="needs a CUDA GPU and a Triton version in flash_native.TESTED_TRITON")
TOL = {torch.float32: 5e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _node_name(out: torch.Tensor) -> str:
    return out.grad_fn.name() if out.grad_fn is not None else ""


def _run(q, k, v, causal, do, native: bool):
    """Output and gradients through FlashAttentionTriton.apply with the node on or off; the node's name."""
    old = ft.NATIVE_NODE
    ft.NATIVE_NODE = native
    try:
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out = FlashAttentionTriton.apply(*leaves, causal)
        name = _node_name(out)
        out.backward(do)
        return [out.detach()] + [x.grad for x in leaves], name
    finally:
        ft.NATIVE_NODE = old


def _rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-6)).item()


# (B, H, N_q, N_k, d, causal, dtype, layout): one-kernel forward + fused backward at short rows, split-KV forward
# at 2048-4096 (B = H = 1), two-pass backward on larger grids, odd lengths, N_q != N_k
SIGNATURES = [
    (1, 1, 1024, 1024, 64, True, torch.bfloat16, "contiguous"),
    (1, 1, 2048, 2048, 64, True, torch.bfloat16, "contiguous"),
    (1, 1, 4096, 4096, 128, True, torch.bfloat16, "contiguous"),
    (1, 1, 2048, 2048, 128, False, torch.float16, "contiguous"),
    (2, 3, 300, 170, 64, True, torch.bfloat16, "contiguous"),
    (2, 3, 170, 300, 32, False, torch.float32, "contiguous"),
    (4, 8, 1024, 1024, 64, True, torch.bfloat16, "model"),
    (1, 1, 777, 777, 96, True, torch.bfloat16, "contiguous"),
]


def _make(b, h, n_q, n_k, d, dtype, layout):
    if layout == "model":  # (B, T, H, D) transposed to (B, H, T, D)
        q = torch.randn(b, n_q, h, d, device="cuda", dtype=dtype).transpose(1, 2)
        k, v = (torch.randn(b, n_k, h, d, device="cuda", dtype=dtype).transpose(1, 2) for _ in range(2))
    else:
        q = torch.randn(b, h, n_q, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(b, h, n_k, d, device="cuda", dtype=dtype) for _ in range(2))
    return q, k, v


@gpu
@needs_gpu
@pytest.mark.parametrize("sig", SIGNATURES, ids=lambda s: f"{s[0]}x{s[1]}_{s[2]}x{s[3]}_d{s[4]}_"
                         f"{'causal' if s[5] else 'full'}_{str(s[6])[6:]}_{s[7]}")
def test_gpu_node_equals_python_function(sig):
    b, h, n_q, n_k, d, causal, dtype, layout = sig
    torch.manual_seed(0)
    q, k, v = _make(b, h, n_q, n_k, d, dtype, layout)
    do = torch.randn(b, h, n_q, d, device="cuda", dtype=dtype)
    ref, name_py = _run(q, k, v, causal, do, native=False)
    assert "FlashFunction" not in name_py
    first, _ = _run(q, k, v, causal, do, native=True)  # records the plans (forward, then backward)
    assert flash_native.plan_counts()[0] >= 1
    for _ in range(2):  # replays
        got, name = _run(q, k, v, causal, do, native=True)
        assert "FlashFunction" in name, name
        for a, r, what in zip(got, ref, ("out", "dq", "dk", "dv")):
            assert a.dtype == r.dtype and a.shape == r.shape and a.stride() == r.stride(), what
            assert torch.equal(a, r), what
    for a, r in zip(first, ref):
        assert torch.equal(a, r)
    # and against float64
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    out64, _ = reference_attention(qr, kr, vr, causal)
    out64.backward(do.double())
    for a, r in zip(got, (out64.detach(), qr.grad, kr.grad, vr.grad)):
        assert _rel(a, r) < TOL[dtype]


@gpu
@needs_gpu
def test_gpu_node_inputs_and_gradients_of_other_layouts():
    """Unaligned views, the same tensor as q, k and v, an expanded gradient (sum().backward()), a gradient of
    another dtype: each its own signature, each equal to the Python Function's result."""
    torch.manual_seed(1)
    n, d = 1024, 64
    buf = torch.randn(n * d + 8, device="cuda", dtype=torch.bfloat16)
    unaligned = buf[4:4 + n * d].view(1, 1, n, d)
    x = torch.randn(1, 1, n, d, device="cuda", dtype=torch.bfloat16)
    cases = [(unaligned, x, x.clone()), (x, x, x)]
    for q, k, v in cases:
        do = torch.randn_like(q)
        ref, _ = _run(q, k, v, True, do, native=False)
        for _ in range(2):
            got, name = _run(q, k, v, True, do, native=True)
        assert "FlashFunction" in name
        assert all(torch.equal(a, r) for a, r in zip(got, ref))
    q, k, v = (x.detach().requires_grad_() for x in (x, x.clone(), x.clone()))
    for native in (False, True, True):
        ft.NATIVE_NODE = native
        try:
            for t in (q, k, v):
                t.grad = None
            FlashAttentionTriton.apply(q, k, v, True).float().sum().backward()  # expanded fp32 gradient, cast
            grads = [t.grad.clone() for t in (q, k, v)]
        finally:
            ft.NATIVE_NODE = True
        if not native:
            ref = grads
    assert all(torch.equal(a, r) for a, r in zip(grads, ref))


@gpu
@needs_gpu
def test_gpu_node_saves_one_logsumexp_and_keeps_python_path_where_it_must():
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 512, 64, device="cuda", requires_grad=True) for _ in range(3))
    for _ in range(2):
        FlashAttentionTriton.apply(q, k, v, True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = FlashAttentionTriton.apply(q, k, v, True)
    assert "FlashFunction" in _node_name(out)
    assert len(packed) == 5 and packed[4].shape == (1, 2, 512) and packed[4].dtype == torch.float32
    # autocast, 3-D inputs and torch.compile take the Python Function (or the custom ops)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert "FlashFunction" not in _node_name(FlashAttentionTriton.apply(q, k, v, True))
    assert "FlashFunction" not in _node_name(FlashAttentionTriton.apply(q[0], k[0], v[0], True))
    # a knob change drops the plans: the split-KV forward off gives the one-kernel forward's result
    q1, k1, v1 = (torch.randn(1, 1, 2048, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    FlashAttentionTriton.apply(q1, k1, v1, True)
    split = FlashAttentionTriton.apply(q1, k1, v1, True)
    old = ft.FWD_SPLIT
    ft.FWD_SPLIT = False
    try:
        FlashAttentionTriton.apply(q1, k1, v1, True)
        one = FlashAttentionTriton.apply(q1, k1, v1, True)
        ft.NATIVE_NODE = False
        one_py = FlashAttentionTriton.apply(q1, k1, v1, True)
    finally:
        ft.FWD_SPLIT, ft.NATIVE_NODE = old, True
    assert torch.equal(one, one_py) and not torch.equal(one, split)


@gpu
@needs_gpu
def test_gpu_split_forward_counts_on_streams_and_in_graphs():
    """The one-launch split-KV forward shares per-stream arrival counts between launches: launches racing on two
    streams, through the node and the Python path, and CUDA graphs replayed on two streams at once all give the
    serial results bit for bit, and every count is back at 0 afterwards."""
    torch.manual_seed(3)
    shapes = [(1024, 128), (1024, 64), (2048, 64)]  # the short (32-row, one loop) and the 64-row split forward
    inputs = [[torch.randn(1, 1, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
              for n, d in shapes for _ in range(2)]
    with torch.no_grad():
        expected = [ft.flash_fwd_impl(q, k, v, True)[0] for q, k, v in inputs]
        for q, k, v in inputs:  # records the plans
            FlashAttentionTriton.apply(q, k, v, True)
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        results: list[list] = [[], []]
        torch.cuda.synchronize()
        for rep in range(20):
            for j, stream in enumerate(streams):
                with torch.cuda.stream(stream):
                    for i in range(j, len(inputs), 2):
                        q, k, v = inputs[i]
                        out = FlashAttentionTriton.apply(q, k, v, True) if rep % 2 else ft.flash_fwd_impl(q, k, v, True)[0]
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
    assert all(not c.any() for c in ft._ARRIVALS._by_stream.values())


@gpu
@needs_gpu
def test_gpu_node_bad_input_gets_the_same_error():
    q = torch.randn(1, 1, 64, 264, device="cuda", dtype=torch.bfloat16)  # head dim 264: over the 256 supported
    with pytest.raises(ConfigError, match="head dim 264"):
        FlashAttentionTriton.apply(q, q, q, True)


# ------------------------------------------------------------------ CPU
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="needs a C++ compiler")
def test_extension_builds_against_this_torch():
    """The node's source compiles against the installed torch (CPU or CUDA build: it needs no CUDA headers),
    and CPU tensors are left to the Python path."""
    ext = flash_native.extension()
    assert ext is not None, "the C++ autograd node did not build"
    x = torch.randn(1, 1, 8, 16)
    before = tuple(ext.stats())  # (plans, kept on the Python path, backward plans): GPU tests may have made some
    assert ext.apply(x, x, x, True) == ext.PYTHON_PATH
    assert tuple(ext.stats()) == before and len(before) == 3


def test_recorder_refuses_what_it_cannot_replay():
    """A run that does more than allocate (here a copy) is not replayable, and says so; one that autotuned may
    be replayable next time."""
    x = torch.randn(4, 4)
    spec, never = flash_native._record(lambda: (torch.empty_like(x), x.clone()), (x,))
    assert spec is None and never

    def autotuned():
        ft._RECORDER.current.unreplayable("autotuning", retry=True)
        return (torch.empty_like(x),)
    spec, never = flash_native._record(autotuned, (x,))
    assert spec is None and not never
    spec, never = flash_native._record(lambda: (torch.empty_like(x),), (x,))
    assert spec is None and never  # nothing launched
    assert ft._RECORDER.current is None
