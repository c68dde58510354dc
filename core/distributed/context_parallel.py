"""Context parallelism over the mesh's cp axis: the `context_parallel` plugins (docs/context_parallel.md).

`RingContextParallel` is ours: ring attention. Every cp rank holds 2 of the sequence's 2*cp equal chunks, chunk r
and chunk 2*cp-1-r (causal load balancing: an early chunk, which sees few keys, with a late one, which sees many),
for the inputs and the targets alike; everything outside attention is per token and runs on those tokens only.
Attention needs every earlier key, so the K/V blocks travel around the cp ring:

    step i (i = 0 .. cp-1): hold the K/V of rank (r - i) mod cp; start sending it to rank r+1 and receiving the
    next one from rank r-1 (batched isend/irecv), attend this rank's queries to the held block, merge the partial
    output with the running one by the log-sum-exp, then wait for the transfer.

Under the causal mask a block is either this rank's own (causal, step 0) or, by the load balancing, seen whole by
all local queries (an earlier rank's first chunk) or by the local second chunk only (a later rank's two chunks):
every rank computes the same amount at every step after the first. Backward runs the ring again: the K/V blocks
travel as in forward, and each block's dK/dV accumulator travels with it, gathering every rank's contribution
until one more hop brings it home. The saved output and merged log-sum-exp let each block's backward recompute
its probabilities exactly (FlashAttention-2's backward).

The per-block math is the attention implementation's own where it can be called per block with a log-sum-exp:
attention_impl=flash_torch calls `core.kernels.flash_torch.flash_forward / flash_backward` and
attention_impl=flash_triton calls `flash_triton.flash_fwd_impl / flash_bwd_impl` (GPU). SDPA and naive return no
log-sum-exp, so under those the ring uses `math_block_forward / _backward` (the whole block's scores in fp32:
fine at the block sizes a rank holds, which is the point of cp). Anything else is refused before ranks start.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from core.attention import AttentionImpl, repeat_kv
from core.distributed.comm import AxisCommTiming, CommTimer
from core.distributed.mesh import ParallelMesh
from core.errors import ConfigError, require
from core.kernels._flash_common import autocast_dtype
from core.model import CausalSelfAttention


# ---- the sequence layout ---------------------------------------------------------------------------------
def chunk_indices(seq_len: int, cp: int, rank: int) -> Tensor:
    """Positions (int64, ascending) of the tokens cp rank `rank` holds: chunks `rank` and `2*cp-1-rank` of
    the sequence cut into 2*cp equal chunks."""
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)
    return torch.cat((first, second))


def shard_sequence(x: Tensor, cp: int, rank: int, dim: int = 1) -> Tensor:
    """`x`'s tokens (along `dim`) that cp rank `rank` holds, as one contiguous tensor."""
    c = x.shape[dim] // (2 * cp)
    return torch.cat((x.narrow(dim, rank * c, c), x.narrow(dim, (2 * cp - 1 - rank) * c, c)), dim=dim)


# ---- block kernels: (out, lse) forward and a backward that takes the merged out and lse ----------------
class BlockKernel(NamedTuple):
    """One attention block's forward `(q, k, v, causal) -> (out, lse)` and backward
    `(do, q, k, v, out, lse, causal) -> (dq, dk, dv)`; q, k, v have equal head counts, causal blocks are square."""

    name: str
    forward: Callable[..., tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]


def math_block_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    """Attention of one block with its whole score matrix in fp32: (out in q's dtype, lse fp32)."""
    s = (q.float() @ k.float().transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        s = s.masked_fill(~_square_causal(s.shape[-1], q.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return (torch.exp(s - lse.unsqueeze(-1)) @ v.float()).to(q.dtype), lse


def math_block_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                        causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the merged output and log-sum-exp (FlashAttention-2's recomputation)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    qf, kf, vf, dof = q.float(), k.float(), v.float(), do.float()
    s = (qf @ kf.transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(~_square_causal(s.shape[-1], q.device), float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))
    delta = (dof * o.float()).sum(-1, keepdim=True)
    ds = p * (dof @ vf.transpose(-2, -1) - delta) * scale
    return (ds @ kf).to(q.dtype), (ds.transpose(-2, -1) @ qf).to(k.dtype), (p.transpose(-2, -1) @ dof).to(v.dtype)


def _square_causal(n: int, device) -> Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def _flash_torch(attention=None) -> BlockKernel:
    from core.kernels.flash_torch import flash_backward, flash_forward

    return BlockKernel("flash_torch", flash_forward, flash_backward)


def _flash_triton(attention=None) -> BlockKernel:
    """The Triton kernels with the attention implementation's `FlashConfig`; the two-pass backward (no atomics),
    whatever the config's `backward` policy picks for a whole sequence."""
    from core.kernels import flash_triton as ft

    config = getattr(attention, "config", None) or ft.DEFAULT_CONFIG

    def four(x: Tensor) -> Tensor:  # the kernels take contiguous (Z, H, N, d)
        return x.contiguous().reshape(-1, *x.shape[-3:])

    def forward(q, k, v, causal):
        o, lse = ft.flash_fwd_impl(four(q), four(k), four(v), causal, config)
        return o.reshape(q.shape), lse.reshape(q.shape[:-1])

    def backward(do, q, k, v, o, lse, causal):
        q4 = four(q)
        dq, dk, dv = ft.flash_bwd_impl(four(do), q4, four(k), four(v), four(o),
                                       lse.contiguous().reshape(q4.shape[:-1]), causal, ft.BWD_TWO_PASS, config)
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)

    return BlockKernel("flash_triton", forward, backward)


def _math(attention=None) -> BlockKernel:
    return BlockKernel("math", math_block_forward, math_block_backward)


# the attention implementation (its kernel's dotted path, or its class's) -> the block kernel the ring calls
BLOCK_KERNELS: dict[str, Callable[..., BlockKernel]] = {
    "core.kernels.flash_torch.FlashAttentionTorch": _flash_torch,
    "core.kernels.flash_triton.FlashAttentionTriton": _flash_triton,
    "core.attention.SDPAAttention": _math,
    "core.attention.NaiveAttention": _math,
}


def attention_key(attention) -> str:
    """The key of `BLOCK_KERNELS` for an attention implementation object or its config (`_target_`, `kernel`)."""
    if isinstance(attention, AttentionImpl):
        kernel = getattr(attention, "kernel", None)
        return kernel if isinstance(kernel, str) else f"{type(attention).__module__}.{type(attention).__qualname__}"
    return str(attention.get("kernel") or attention.get("_target_"))


# ---- the ring ---------------------------------------------------------------------------------------------
class RingComm:
    """The cp group's ring: batched isend/irecv to the next rank / from the previous one, timed."""

    def __init__(self, group, timer: CommTimer | None = None, overlap: bool = True) -> None:
        self.group = group
        ranks = dist.get_process_group_ranks(group)
        self.world = len(ranks)
        self.rank = dist.get_rank(group)
        self.next, self.prev = ranks[(self.rank + 1) % self.world], ranks[(self.rank - 1) % self.world]
        self.timer = timer
        self.overlap = overlap

    def start(self, tensors: list[Tensor]) -> tuple[list[Tensor], list]:
        """Send `tensors` to the next rank and receive same-shaped ones from the previous: (received, works)."""
        tensors = [t.contiguous() for t in tensors]  # q, k, v arrive as views of the fused projection
        recv = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in recv]
        works = dist.batch_isend_irecv(ops)
        if self.timer is not None:
            for w in works:
                self.timer.launched(w, self.group)
        if not self.overlap:
            self.wait(works)
        return recv, works

    def wait(self, works: list) -> None:
        """Wait for a batch; the time spent waiting is the exposed part of the ring's communication."""
        for w in works:
            if self.timer is not None:
                self.timer.wait(w)
            else:
                w.wait()


def _visible(step: int, rank: int, world: int, causal: bool, c: int) -> tuple[slice, slice, bool]:
    """(local query rows, rows of the held K/V block, causal mask?) that attend at ring step `step`, where the
    block is rank (rank - step) mod world's two chunks of `c` tokens each (module docstring)."""
    if not causal:
        return slice(None), slice(None), False
    if step == 0:
        return slice(None), slice(None), True
    if (rank - step) % world < rank:  # an earlier rank: its first chunk precedes both of ours, its second follows
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False  # a later rank: both its chunks precede our second chunk only


def _expand(x: Tensor, heads: int) -> Tensor:
    return repeat_kv(x, heads)


def _fold(dx: Tensor, kv_heads: int) -> Tensor:
    """Sum the gradient of a kv tensor expanded by `repeat_kv` back over each group of query heads."""
    h = dx.shape[-3]
    if h == kv_heads:
        return dx
    return dx.unflatten(-3, (kv_heads, h // kv_heads)).sum(-3)


def ring_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, comm: RingComm,
                 kernel: BlockKernel) -> tuple[Tensor, Tensor]:
    """This rank's attention output (q's dtype) and log-sum-exp (fp32) over the whole ring's keys.
    q (..., H, 2c, E); k, v (..., K, 2c, E) with K dividing H."""
    heads, rank, world, c = q.shape[-3], comm.rank, comm.world, q.shape[-2] // 2
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    held = [k, v]
    for step in range(world):
        pending = comm.start(held) if step < world - 1 else None
        rows, cols, masked = _visible(step, rank, world, causal, c)
        o_b, l_b = kernel.forward(q[..., rows, :], _expand(held[0][..., cols, :], heads),
                                  _expand(held[1][..., cols, :], heads), masked)
        l_old = lse[..., rows]
        l_new = torch.logaddexp(l_old, l_b)
        out[..., rows, :] = (out[..., rows, :] * torch.exp(l_old - l_new).unsqueeze(-1)
                             + o_b.float() * torch.exp(l_b - l_new).unsqueeze(-1))
        lse[..., rows] = l_new
        if pending is not None:
            comm.wait(pending[1])
            held = pending[0]
    return out.to(q.dtype), lse


def ring_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                  comm: RingComm, kernel: BlockKernel) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of this rank's q, k, v: K/V blocks go around the ring again, each with its dK/dV accumulator,
    which a last hop returns to the block's owner."""
    heads, kv_heads, rank, world, c = q.shape[-3], k.shape[-3], comm.rank, comm.world, q.shape[-2] // 2
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    held, grads_in = [k, v], None
    for step in range(world):
        pending = comm.start(held) if step < world - 1 else None
        rows, cols, masked = _visible(step, rank, world, causal, c)
        kb, vb = held[0][..., cols, :], held[1][..., cols, :]
        dq_b, dk_b, dv_b = kernel.backward(do[..., rows, :], q[..., rows, :], _expand(kb, heads),
                                           _expand(vb, heads), out[..., rows, :], lse[..., rows], masked)
        dq[..., rows, :] += dq_b.float()
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros_like(dk)
        dk[..., cols, :] = _fold(dk_b.float(), kv_heads)
        dv[..., cols, :] = _fold(dv_b.float(), kv_heads)
        if grads_in is not None:  # the accumulator of this block from the ranks before us
            comm.wait(grads_in[1])
            dk, dv = dk + grads_in[0][0], dv + grads_in[0][1]
        grads_in = comm.start([dk, dv])  # on to the next rank (after the last step: home to the owner)
        if pending is not None:
            comm.wait(pending[1])
            held = pending[0]
    comm.wait(grads_in[1])
    dk, dv = grads_in[0]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttentionFunction(torch.autograd.Function):
    """``RingAttentionFunction.apply(q, k, v, is_causal, comm, kernel)``: ring attention with its ring backward."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, is_causal: bool, comm: RingComm, kernel: BlockKernel):
        dtypes = (q.dtype, k.dtype, v.dtype)
        cast = autocast_dtype(q.device.type)
        if cast is not None:
            q, k, v = q.to(cast), k.to(cast), v.to(cast)
        with torch.autocast(q.device.type, enabled=False):
            out, lse = ring_forward(q, k, v, bool(is_causal), comm, kernel)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal, ctx.comm, ctx.kernel, ctx.dtypes = bool(is_causal), comm, kernel, dtypes
        return out

    @staticmethod
    def backward(ctx, do: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = ring_backward(do.to(q.dtype).contiguous(), q, k, v, out, lse, ctx.is_causal, ctx.comm,
                                       ctx.kernel)
        tq, tk, tv = ctx.dtypes
        return dq.to(tq), dk.to(tk), dv.to(tv), None, None, None


class RingAttention(AttentionImpl):
    """The attention implementation a block gets under cp > 1: ring attention over `comm` with `kernel` blocks."""

    def __init__(self, comm: RingComm, kernel: BlockKernel, inner_name: str) -> None:
        self.comm, self.kernel = comm, kernel
        self.name = f"ring[{inner_name}]"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = True) -> Tensor:
        return RingAttentionFunction.apply(q, k, v, is_causal, self.comm, self.kernel)


class SlicedRotary:
    """RoPE for a cp rank's tokens: the model numbers them 0..T_local-1; they are rotated by their positions in
    the whole sequence (`chunk_indices`)."""

    def __init__(self, rope: nn.Module, cp: int, rank: int) -> None:
        self.rope, self.cp, self.rank = rope, cp, rank
        self._table: Tensor | None = None

    def __call__(self, x: Tensor, positions: Tensor) -> Tensor:
        n = positions.shape[0]
        if self._table is None or self._table.shape[0] != n or self._table.device != positions.device:
            self._table = chunk_indices(n * self.cp, self.cp, self.rank).to(positions.device)
        return self.rope(x, self._table[positions])


# ---- the plugins --------------------------------------------------------------------------------------------
class ContextParallel(AxisCommTiming):
    """Base of the `context_parallel` plugins; with `mesh.cp == 1` a plugin changes nothing.

    `validate` refuses what cannot run (before ranks start), `apply` swaps the model's attention (in the parallelize
    step), `shard_batch` gives each cp rank its tokens of a micro-batch, `finish_gradients` averages the replicated
    weights' gradients over cp where the strategy does not (its data-parallel group is dp x cp otherwise)."""

    name = "none"
    comm_axis = "cp"
    composes_with: tuple[str, ...] = ()
    tensor_parallel_with: tuple[str, ...] = ("megatron",)
    pipelines_with: tuple[str, ...] = ("ours",)  # pipeline plugins whose stages run the ring (mesh.pp > 1)

    def __init__(self) -> None:
        self.active = False
        self.cp, self.rank = 1, 0

    def validate(self, mesh: ParallelMesh, model_cfg, cfg, strategy_name: str, tensor_parallel_name: str) -> None:
        """One-line ConfigErrors for everything cp > 1 cannot do yet (called before any process starts)."""
        cp = mesh.cp
        if cp == 1:
            return
        seq_len = int(cfg.data.seq_len)
        if seq_len % (2 * cp):
            up = -(-seq_len // (2 * cp)) * 2 * cp
            raise ConfigError("data.seq_len", f"context parallelism cuts data.seq_len={seq_len} into 2*cp={2 * cp} "
                              "equal chunks (causal load balancing), which do not divide it",
                              f"choose data.seq_len divisible by {2 * cp} (e.g. {up}) or another mesh.cp")
        if mesh.pp > 1:
            from hydra.utils import instantiate

            pipeline = instantiate(cfg.pipeline).name
            require(pipeline in self.pipelines_with, "pipeline", f"pipeline={pipeline} does not compose with context "
                    f"parallelism (mesh.cp={cp}, mesh.pp={mesh.pp})",
                    f"use pipeline={' or '.join(self.pipelines_with)}")
        require(strategy_name in self.composes_with, "parallelism",
                f"parallelism={strategy_name} does not compose with context_parallel={self.name} (mesh.cp={cp})",
                f"use one of {', '.join(self.composes_with)}")
        if mesh.tp > 1:
            require(tensor_parallel_name in self.tensor_parallel_with, "tensor_parallel",
                    f"tensor_parallel={tensor_parallel_name} does not compose with context parallelism (mesh.cp={cp})",
                    f"use tensor_parallel={' or '.join(self.tensor_parallel_with)}")
            sp = bool(cfg.tensor_parallel.get("sequence_parallel", False))
            require(not sp or (seq_len // cp) % mesh.tp == 0, "tensor_parallel.sequence_parallel",
                    f"each cp rank's {seq_len // cp} tokens do not split over tp={mesh.tp}",
                    f"choose data.seq_len divisible by {2 * cp * mesh.tp // math.gcd(2, mesh.tp)}, or "
                    "tensor_parallel.sequence_parallel=false")
        require(not model_cfg.n_experts, "model.n_experts", f"a mixture-of-experts model with mesh.cp={cp} is not "
                "implemented yet (the load-balancing loss is not per token)",
                "set mesh.cp=1 or model.n_experts=0 (a dense model)")
        require(not cfg.get("compile", False), "compile", f"torch.compile with mesh.cp={cp} is not supported "
                "(the ring's send/receive inside the blocks)", "set compile=false")
        key = attention_key(cfg.attention_impl)
        require(key in BLOCK_KERNELS, "attention_impl", f"{key} cannot run as ring-attention blocks (no per-block "
                "log-sum-exp)", "use attention_impl=flash_torch, flash_triton, sdpa or naive")

    def describe(self) -> str:
        return f"{self.name}(cp={self.cp})" if self.active else "none"

    def attention_name(self, inner: str) -> str:
        """What the run's attention is called in its banner and summary: `ring[sdpa]` under cp > 1."""
        return f"{self.name}[{inner}]" if self.active else inner

    def apply(self, model: nn.Module, mesh: ParallelMesh) -> None:
        self.active = mesh.cp > 1

    def shard_batch(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """This cp rank's tokens of a micro-batch's inputs and targets."""
        if not self.active:
            return x, y
        return shard_sequence(x, self.cp, self.rank), shard_sequence(y, self.cp, self.rank)

    def finish_gradients(self, model: nn.Module, strategy) -> None:
        """Average the gradients over cp for a strategy without a data-parallel group (which would include cp)."""

    def collectives(self, mesh: ParallelMesh, model_cfg, micro_batch: int, seq_len: int, activation_bytes: int,
                    micro_steps: int, recomputed_blocks: int) -> list:
        """The cp axis's point-to-point transfers of one optimizer step per rank (`CollectiveSpec`s, calls = ring
        steps with a transfer), as `RingContextParallel` runs them, per block and micro-step:

        - forward: cp - 1 steps each send this rank's held K and V, (B, K/tp, seq/cp, E) in `activation_bytes`;
        - backward: the same cp - 1 K/V steps, and cp steps each sending a dK and a dV accumulator (float32);
        - a recomputed (checkpointed) block runs its forward's cp - 1 K/V steps again.
        All of it is launched before the block it overlaps (overlappable)."""
        cp = mesh.cp
        if cp == 1:
            return []
        from core.distributed.strategy import CollectiveSpec

        kv = 2 * micro_batch * (model_cfg.kv_heads // mesh.tp) * (seq_len // cp) * model_cfg.head_dim
        calls = micro_steps * (2 * model_cfg.n_layers + recomputed_blocks) * (cp - 1)
        grads = micro_steps * model_cfg.n_layers * cp
        return [CollectiveSpec("send_recv", "kv blocks", calls * kv * activation_bytes, calls, ("cp",), True),
                CollectiveSpec("send_recv", "dkv blocks", grads * kv * 4, grads, ("cp",), True)]


class RingContextParallel(ContextParallel):
    """Ours: ring attention over mesh.cp with causal load balancing (module docstring). `overlap=False` waits for
    each K/V transfer before computing (to measure what the overlap hides)."""

    name = "ring"
    composes_with = ("none", "ddp_naive", "ddp_flat", "ddp_overlap", "ddp_bucketed", "zero1", "zero1_rs", "fsdp")

    def __init__(self, overlap: bool = True) -> None:
        super().__init__()
        self.overlap = bool(overlap)

    def apply(self, model: nn.Module, mesh: ParallelMesh) -> None:
        super().apply(model, mesh)
        if not self.active:
            return
        self.cp, self.rank = mesh.cp, mesh.cp_rank
        self.timer = CommTimer(mesh.device_obj, enabled=False)
        self.comm = RingComm(mesh.group("cp"), self.timer, self.overlap)
        rings: dict[int, RingAttention] = {}
        for block in model.blocks:
            if not isinstance(getattr(block, "attn", None), CausalSelfAttention):  # another pipeline stage's
                continue
            inner = block.attn.attention
            key = attention_key(inner)
            require(key in BLOCK_KERNELS, "attention_impl", f"{key} cannot run as ring-attention blocks",
                    "use attention_impl=flash_torch, flash_triton, sdpa or naive")
            if id(inner) not in rings:
                rings[id(inner)] = RingAttention(self.comm, BLOCK_KERNELS[key](inner), getattr(inner, "name", key))
            block.attn.attention = rings[id(inner)]
            block.attn.rope = (SlicedRotary(block.attn.rope[0], self.cp, self.rank),)

    def finish_gradients(self, model: nn.Module, strategy) -> None:
        if not self.active or getattr(strategy, "data_parallel", False):
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.comm.group)
        flat /= self.cp
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
