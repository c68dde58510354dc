"""FlashAttention-2 forward and backward in Triton (CS336 section 4.2), with Hopper kernels in Gluon.

    from core.kernels.flash_triton import FlashAttentionTriton, FlashConfig
    out = FlashAttentionTriton.apply(q, k, v, is_causal)                       # q (..., N_q, d), k/v (..., N_k, d)
    out = FlashAttentionTriton.apply(q, k, v, is_causal, FlashConfig(backward="fused"))

Modules, in the order a call goes through them (docs/attention.md, "Files"):

- `config`: `FlashConfig`, every choice besides the inputs (tiles, backward variant, split-KV policy), built from
  conf/attention_impl/flash_triton.yaml;
- `autograd`: `FlashAttentionTriton`, the autograd Function;
- `dispatch`: which kernels run for a call, the allocations, the custom ops `torch.compile` sees;
- `launch`: tiles (pinned, interpreter, autotuned), grids, direct launches, per-device lookups;
- `tuning`: the autotuner's config lists and choices;
- `forward`, `backward`: the Triton kernels; `common`: the tile helpers both use;
- `hopper`: the warp-specialised backward for sm_90 in Gluon (wgmma, TMA); `hopper_forward`: the
  warp-specialised forward for sm_90 in Gluon (head dims 64 on long rows, 80, 96, 128).

Causal with N_q != N_k is bottom-right aligned: query i sees keys j <= i + N_k - N_q.
Rows that see no key give output 0 and logsumexp -inf.
"""
from core.kernels.flash_triton.autograd import FlashAttentionTriton, flash_attention_with_lse
from core.kernels.flash_triton.common import HAVE_TRITON
from core.kernels.flash_triton.config import DEFAULT_CONFIG, FlashConfig
from core.kernels.flash_triton.dispatch import (BWD_ATOMIC_DQ, BWD_FUSED, BWD_TWO_PASS, flash_attn_bwd, flash_attn_fwd,
                                                flash_bwd_impl, flash_fwd_impl)
from core.kernels.flash_triton.tuning import tuned_configs

__all__ = ["FlashAttentionTriton", "FlashConfig", "DEFAULT_CONFIG", "flash_attention_with_lse", "flash_fwd_impl",
           "flash_bwd_impl", "flash_attn_fwd", "flash_attn_bwd", "BWD_TWO_PASS", "BWD_ATOMIC_DQ", "BWD_FUSED",
           "tuned_configs", "HAVE_TRITON"]
