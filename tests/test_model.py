"""The model against an independent float64 reference, and the attention plugins against each other."""
import math

import pytest
import torch

from core.attention import KernelAttention, NaiveAttention, SDPAAttention
from core.errors import ConfigError
from core.model import ModelConfig, TransformerLM


def reference_lm(sd: dict[str, torch.Tensor], cfg: ModelConfig, tokens: torch.Tensor) -> torch.Tensor:
    """The CS336 Transformer LM written out in float64 from its equations (no module code reused)."""
    p = {k: v.double() for k, v in sd.items()}
    H, K, E, d = cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.d_model
    B, T = tokens.shape

    def rmsnorm(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * w

    i = torch.arange(E // 2, dtype=torch.float64)
    freq = cfg.rope_theta ** (-2 * i / E)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * freq[None, :]  # (T, E/2)

    def rope(x):  # x (B, h, T, E): rotate pairs (2i, 2i+1) by angle pos * theta^(-2i/E)
        out = x.clone()
        c, s = torch.cos(ang), torch.sin(ang)
        out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
        out[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
        return out

    x = p["token_embeddings.weight"][tokens]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for layer in range(cfg.n_layers):
        pre = f"blocks.{layer}."
        h = rmsnorm(x, p[pre + "ln1.weight"])
        w = p[pre + "attn.qkv_proj.weight"]
        wq, wk, wv = w[: H * E], w[H * E: (H + K) * E], w[(H + K) * E:]
        q = (h @ wq.T).view(B, T, H, E).transpose(1, 2)
        k = (h @ wk.T).view(B, T, K, E).transpose(1, 2).repeat_interleave(H // K, dim=1)
        v = (h @ wv.T).view(B, T, K, E).transpose(1, 2).repeat_interleave(H // K, dim=1)
        q, k = rope(q), rope(k)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(E)
        scores = scores.masked_fill(~causal, float("-inf"))
        att = torch.softmax(scores, -1) @ v
        x = x + att.transpose(1, 2).reshape(B, T, H * E) @ p[pre + "attn.output_proj.weight"].T
        h = rmsnorm(x, p[pre + "ln2.weight"])
        a, b = h @ p[pre + "ffn.w1.weight"].T, h @ p[pre + "ffn.w3.weight"].T
        x = x + (a * torch.sigmoid(a) * b) @ p[pre + "ffn.w2.weight"].T
    return rmsnorm(x, p["final_norm.weight"]) @ p["lm_head.weight"].T


@pytest.mark.parametrize("n_kv_heads", [None, 2])
@pytest.mark.parametrize("attention", [NaiveAttention(), SDPAAttention("math")])
def test_model_matches_float64_reference(n_kv_heads, attention):
    cfg = ModelConfig(d_model=32, d_ff=80, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, vocab_size=50,
                      context_length=16)
    torch.manual_seed(0)
    model = TransformerLM(cfg, attention)
    model.init_weights(seed=1)
    with torch.no_grad():  # non-trivial norm weights so a wrong norm would show
        for name, prm in model.named_parameters():
            if prm.dim() == 1:
                prm.uniform_(0.5, 1.5)
    tokens = torch.randint(0, cfg.vocab_size, (2, 11))
    ref = reference_lm(model.state_dict(), cfg, tokens)
    model.double()
    out = model(tokens)
    assert out.shape == (2, 11, cfg.vocab_size)
    # the RoPE tables are float32 buffers (as in training), so agreement is to ~1e-7, not 1e-15
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_param_count_formula_matches_module():
    for kv in (None, 1, 3):
        cfg = ModelConfig(d_model=48, d_ff=100, n_layers=3, n_heads=6, n_kv_heads=kv, vocab_size=77)
        model = TransformerLM(cfg)
        assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_meta_build_then_init_matches_eager_init():
    cfg = ModelConfig(d_model=32, d_ff=64, n_layers=2, n_heads=4, vocab_size=40, context_length=8)
    with torch.device("meta"):
        meta = TransformerLM(cfg)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    meta.init_weights(seed=3)
    eager = TransformerLM(cfg)
    eager.init_weights(seed=3)
    for (n, a), (_, b) in zip(meta.state_dict().items(), eager.state_dict().items()):
        assert torch.equal(a, b), n
    torch.testing.assert_close(meta.rope.cos, eager.rope.cos)


@pytest.mark.parametrize("t_q,t_k", [(7, 7), (5, 9)])
def test_attention_impls_agree(t_q, t_k):
    torch.manual_seed(0)
    q = torch.randn(2, 4, t_q, 16, dtype=torch.float64)
    k = torch.randn(2, 2, t_k, 16, dtype=torch.float64)
    v = torch.randn(2, 2, t_k, 16, dtype=torch.float64)
    ref = NaiveAttention()(q, k, v, is_causal=True)
    # bottom-right causal alignment: the last query sees every key
    last = torch.softmax(q[..., -1:, :] @ k.repeat_interleave(2, 1).transpose(-1, -2) / 4.0, -1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(ref[..., -1:, :], last)
    torch.testing.assert_close(SDPAAttention("math")(q, k, v, is_causal=True), ref)


def test_kernel_attention_plugs_in_an_autograd_function():
    class Doubler(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, is_causal):
            return NaiveAttention()(q, k, v, is_causal) * 2

        @staticmethod
        def backward(ctx, g):
            return None, None, None, None

    import sys
    import types

    mod = types.ModuleType("scalelab_test_kernels")
    mod.Doubler = Doubler
    sys.modules["scalelab_test_kernels"] = mod
    impl = KernelAttention("scalelab_test_kernels.Doubler")
    q = torch.randn(1, 4, 5, 8)
    k = torch.randn(1, 2, 5, 8)  # GQA: expanded by the adapter
    torch.testing.assert_close(impl(q, k, k, True), 2 * NaiveAttention()(q, k, k, True))
    with pytest.raises(ConfigError, match="attention_impl.kernel"):
        KernelAttention("no.such.Kernel")
