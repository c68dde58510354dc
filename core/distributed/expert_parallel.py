"""Expert parallelism over the mesh's ep axis: the `expert_parallel` plugin (docs/moe.md, "Expert parallelism").

ep adds no ranks: it borrows them from dp_shard x cp (the mesh's rule). Every ep consecutive ranks of one dp_shard x cp
slice form an ep group; each rank of it holds n_experts / ep of every MoE layer's routed experts (rank i: experts
i E/ep .. (i+1) E/ep - 1) and everything else whole. Each rank still reads its own rows of the batch.

One MoE layer's forward on a rank (N tokens, k choices each, D = d_model):

    router, top-k, capacity drop, aux loss   on the rank's own N tokens, exactly as in one process (core/moe.py)
    count exchange    all_to_all_single of the E kept-copy counts (E / ep to each rank): every rank learns how
                      many copies it receives per (source rank, local expert); the split sizes go to the host
    dispatch          all_to_all_single of the copies (sorted by expert, hence by destination), uneven splits
    local experts     the received copies regrouped by local expert (a stable permutation), SwiGLU as before:
                      the per-expert loop, or torch._grouped_mm on CUDA bf16
    combine           the inverse permutation, then all_to_all_single with the splits swapped: each copy's output
                      returns to its source in its sending order, where the router weights and index_add apply
    backward          the same two all-to-alls, reversed (autograd Functions below)

Overlap: the dispatch all-to-all is launched asynchronously and the shared expert (model.shared_expert) runs while it
is in flight; in backward the dispatch's reverse all-to-all is launched by the later node and waited for by the
earlier one, and autograd runs the shared expert's backward (created between them) in that window. The count
exchange and the combine are exposed: the next computation needs their result. Without a shared expert nothing
hides the all-to-alls.

Gradients: the dense parameters are averaged over all data-parallel ranks by the strategy as without ep. A rank's
expert gradient is the sum over its ep group's tokens (the all-to-all backward brings them), so `finish_gradients`
sums it over the `edp` ranks holding the same experts (dp_replicate x dp_shard x cp / ep) and divides by dp: the
average over all data-parallel ranks, as one process accumulating their micro-batches computes it.

Capacity under ep: applied by each source rank to its own tokens before dispatch (ceil(cf N k / E) per expert per
source rank), so an expert receives at most ep times that per forward. That is one process's capacity for a
micro-batch of the rank's tokens; the aux loss is likewise the rank's own. With ep = 1 nothing here runs.
"""
from __future__ import annotations

import datetime
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from core.distributed.checkpoint_boxes import Boxed
from core.distributed.comm import AxisCommTiming, CommTimer
from core.distributed.mesh import ParallelMesh
from core.distributed.strategy import CollectiveSpec, ModelLayout, expert_sharded_parameters
from core.errors import ConfigError, require
from core.moe import MoEFeedForward


class _Pending:
    """An all-to-all in flight between the two halves of `_AllToAllStart` / `_AllToAllWait` (one per direction)."""

    def __init__(self, dispatcher: "ExpertDispatcher", out_splits: list[int], in_splits: list[int]) -> None:
        self.dispatcher, self.out_splits, self.in_splits = dispatcher, out_splits, in_splits
        self.work: Any = None
        self.grad_work: Any = None
        self.held: tuple[Tensor, ...] = ()  # the in-flight collective's input, alive until it is waited for


class _AllToAllStart(torch.autograd.Function):
    """Launches the all-to-all of `x` (rows split `in_splits` to the group's ranks, `out_splits` received) and returns
    the buffer it fills; `_AllToAllWait` waits for it. Backward waits for the reverse all-to-all its partner
    launched."""

    @staticmethod
    def forward(ctx, x: Tensor, pending: _Pending) -> Tensor:
        ctx.pending = pending
        out = x.new_empty((sum(pending.out_splits), *x.shape[1:]))
        pending.held = (x.contiguous(),)
        pending.work = pending.dispatcher.all_to_all(out, pending.held[0], pending.out_splits, pending.in_splits)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        pending = ctx.pending
        pending.dispatcher.wait(pending.grad_work)
        grad_in, pending.grad_work, pending.grad_out, pending.held = pending.grad_out, None, None, ()
        pending.dispatcher = None  # a graph something keeps alive must not keep the process group alive
        return grad_in, None


class _AllToAllWait(torch.autograd.Function):
    """Waits for `_AllToAllStart`'s all-to-all; backward launches the reverse one (splits swapped)."""

    @staticmethod
    def forward(ctx, y: Tensor, pending: _Pending) -> Tensor:
        ctx.pending = pending
        pending.dispatcher.wait(pending.work)
        pending.work, pending.held = None, ()
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: Tensor):
        pending = ctx.pending
        grad = grad.contiguous()
        pending.grad_out = grad.new_empty((sum(pending.in_splits), *grad.shape[1:]))
        pending.held = (grad,)
        pending.grad_work = pending.dispatcher.all_to_all(pending.grad_out, grad, pending.in_splits,
                                                          pending.out_splits)
        return grad, None  # what _AllToAllStart.backward receives (and ignores: it returns grad_out)


class ExpertDispatcher:
    """Moves one MoE layer's token copies to the ep ranks holding their experts and the outputs back
    (`MoEFeedForward.dispatcher`); shared by every layer of a model."""

    def __init__(self, group: Optional[dist.ProcessGroup], ep: int, timer: CommTimer) -> None:
        self.group, self.ep, self.timer = group, ep, timer

    def all_to_all(self, out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int]) -> Any:
        work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=True)
        return self.timer.launched(work)

    def wait(self, work: Any) -> None:
        if work is not None:
            self.timer.wait(work)

    def exchange(self, x: Tensor, out_splits: list[int], in_splits: list[int],
                 during: Optional[Callable[[], Tensor]] = None) -> tuple[Tensor, Optional[Tensor]]:
        """All-to-all of the rows of `x` (autograd-aware), running `during()` while it is in flight."""
        if torch.is_grad_enabled() and not x.requires_grad:
            # every rank's backward must run the reverse all-to-all, whether or not its own rows need a gradient
            # (a rank no copy reached has nothing to differentiate, but its peers wait for it)
            x = x.detach().requires_grad_()
        pending = _Pending(self, out_splits, in_splits)
        buf = _AllToAllStart.apply(x, pending)
        extra = during() if during is not None else None
        return _AllToAllWait.apply(buf, pending), extra

    def __call__(self, xs: Tensor, counts: Tensor, experts: Callable[[Tensor, Tensor], Tensor],
                 shared: Optional[Callable[[], Tensor]] = None) -> tuple[Tensor, Optional[Tensor]]:
        """`xs`: this rank's kept copies sorted by (global) expert, `counts[e]` of them for expert e. Returns their
        outputs in the same order, computed by `experts(rows, local_counts)` on the ranks holding them, and the
        shared expert's output (`shared()`, run while the copies travel)."""
        ep, n_local = self.ep, counts.numel() // self.ep
        send = counts.reshape(ep, n_local)  # experts are contiguous per rank: row r goes to rank r
        recv = torch.empty_like(send)
        with self.timer.blocking():
            dist.all_to_all_single(recv, send.contiguous(), group=self.group)  # recv[s, j]: from rank s, expert j
        sizes = torch.stack((send.sum(1), recv.sum(1))).tolist()  # one host sync: the split sizes
        send_splits, recv_splits = sizes[0], sizes[1]
        got, shared_out = self.exchange(xs, recv_splits, send_splits, shared)  # rows by source rank, then expert
        # regroup by local expert (stable: source rank order within an expert) and back after the experts
        expert_of_row = torch.repeat_interleave(torch.arange(n_local, device=xs.device).repeat(ep), recv.reshape(-1))
        perm = torch.argsort(expert_of_row, stable=True)
        out = experts(got[perm], recv.sum(0))
        back, _ = self.exchange(out[torch.argsort(perm)], send_splits, recv_splits)
        return back, shared_out


class ExpertParallel(AxisCommTiming):
    """Our expert parallelism (module docstring): shards the routed experts over mesh.ep and averages their
    gradients over the ranks holding the same experts. Nothing changes at mesh.ep = 1.

    overlap: launch the dispatch asynchronously and run the shared expert while it travels (false: blocking)."""

    name = "ours"
    comm_axis = "ep"  # the all-to-alls and the expert gradient all-reduce

    def __init__(self, overlap: bool = True) -> None:
        self.overlap = bool(overlap)
        self.timer: Optional[CommTimer] = None
        self.dispatcher: Optional[ExpertDispatcher] = None
        self.edp_group: Optional[dist.ProcessGroup] = None
        self.dp = 1

    # ---- before any process starts ----
    def validate(self, mesh: ParallelMesh, model_cfg, strategy, compiled: bool = False) -> None:
        """Refuse, in one line each, what expert parallelism cannot run (the mesh itself refuses an ep that does not
        divide dp_shard x cp)."""
        if mesh.ep == 1:
            return
        require(model_cfg.n_experts > 0, "mesh.ep",
                f"ep={mesh.ep} shards experts but model={model_cfg.name} is dense (model.n_experts=0)",
                "set mesh.ep=1, or use a mixture-of-experts model (model=tiny_moe, model=small_moe)")
        require(model_cfg.n_experts % mesh.ep == 0, "mesh.ep",
                f"ep={mesh.ep} does not divide model.n_experts={model_cfg.n_experts}: each rank holds n_experts / ep",
                f"choose mesh.ep dividing {model_cfg.n_experts}")
        require(mesh.cp == 1, "mesh.ep", f"ep={mesh.ep} with mesh.cp={mesh.cp} is not supported yet",
                "set mesh.cp=1 (expert parallelism borrows its ranks from dp_shard)")
        require(getattr(strategy, "supports_expert_parallel", False), "parallelism",
                f"parallelism={strategy.name} does not run with expert parallelism (mesh.ep={mesh.ep}): it would "
                "broadcast or average each rank's own experts", "use parallelism=ddp_bucketed (or ddp_naive, "
                "ddp_flat, ddp_overlap, zero1, zero1_rs, fsdp), or mesh.ep=1")
        require(not compiled, "compile", f"compile=true with mesh.ep={mesh.ep} is not supported yet (the dispatch "
                "reads split sizes on the host)", "set compile=false or mesh.ep=1")

    # ---- checkpoints ----
    def checkpoint_view(self, view, strategy, tensor_parallel, mesh: ParallelMesh):
        """What saves and loads this run's state under ep > 1: for a whole-parameter strategy (the DDP family, ZeRO-1)
        `TensorParallelCheckpoint`, which saves every parameter and its optimizer state by the whole model's name
        through DCP, a rank's experts as their box of the whole layer's tensor (`expert_box`); our fsdp boxes them in
        its own format. Either reads on any ep, dp or cp degree, one process included (`reshardable`)."""
        from core.distributed.tensor_parallel import MegatronTensorParallel, TensorParallelCheckpoint

        if mesh.ep == 1 or view is not strategy or strategy.name not in MegatronTensorParallel.whole_parameter:
            return view
        return TensorParallelCheckpoint(tensor_parallel, mesh, strategy.name, boxes=expert_box)

    # ---- the parallelize step ----
    def apply(self, model: nn.Module, mesh: ParallelMesh) -> None:
        """Keep this rank's experts of every MoE layer of `model` (on the meta device, before materialising) and
        give each layer the dispatcher. Every rank creates every ep and edp group, in one order."""
        if mesh.ep == 1:
            return
        layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
        if not layers:
            raise ConfigError("mesh.ep", f"ep={mesh.ep} but the model has no MoE layers",
                              "set mesh.ep=1 or model.n_experts > 0")
        ep_groups, edp_groups = mesh.ep_group_ranks()
        me, timeout = mesh.rank, datetime.timedelta(seconds=mesh.timeout_s)
        group = edp = None
        for ranks in ep_groups:
            g = dist.new_group(ranks, timeout=timeout)
            if me in ranks:
                group, position = g, ranks.index(me)
        for ranks in edp_groups if mesh.edp > 1 else ():  # ep = dp: no two ranks hold the same experts
            g = dist.new_group(ranks, timeout=timeout)
            if me in ranks:
                edp = g
        self.edp_group = edp
        self.dp = mesh.dp_size * mesh.cp
        self.timer = CommTimer(mesh.device_obj, enabled=False)
        self.dispatcher = ExpertDispatcher(group, mesh.ep, self.timer)
        for layer in layers:
            keep_experts(layer, position, mesh.ep)
            layer.dispatcher = _LayerDispatch(self.dispatcher, self.overlap)

    # ---- each step ----
    @torch.no_grad()
    def finish_gradients(self, model: nn.Module) -> None:
        """Average the expert gradients over all data-parallel ranks (module docstring): one flat all-reduce over the
        ranks holding the same experts, then / dp. Called once per optimizer step after the strategy's sync."""
        if self.dispatcher is None:
            return
        ids = expert_sharded_parameters(model)
        params = [p for p in model.parameters() if id(p) in ids]
        for p in params:
            if p.grad is None:  # no token reached this rank's experts of a layer: a zero gradient, synced like any
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        if self.edp_group is not None:
            flat = torch._utils._flatten_dense_tensors(grads)
            with self.timer.blocking():
                dist.all_reduce(flat, group=self.edp_group)
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)
        torch._foreach_div_(grads, float(self.dp))

    # ---- the planner ----
    def collectives(self, mesh: ParallelMesh, model_cfg, micro_batch: int, seq_len: int, activation_bytes: int,
                    micro_steps: int, recomputed_blocks: int = 0) -> list[CollectiveSpec]:
        """The ep axis's collectives of one optimizer step, per rank, dropless:

        - per MoE layer and micro-step, four all-to-alls of B T k copies of d_model values: the dispatch forward and
          backward in the residual stream's float32 (the norm's output and its gradient), the combine forward and
          backward in `activation_bytes` (the experts' output, bf16 under autocast); a recomputed block repeats
          both forwards. Counted as what each rank hands to all_to_all_single, its own slice included (under even
          routing (ep-1)/ep of it leaves the rank). A rank sends its own B T k copies out and the rows it received
          back, so per rank this is the mean over the ep group (exactly it for the rank's own copies);
        - the count exchange, E int64 per layer and forward;
        - the expert gradients' all-reduce over the edp ranks holding the same experts, once per step (fp32)."""
        if mesh.ep == 1 or not model_cfg.n_experts:
            return []
        layers, d = model_cfg.n_layers, model_cfg.d_model
        copies = micro_batch * seq_len * model_cfg.top_k
        calls = micro_steps * (2 * layers + recomputed_blocks)  # of each: the dispatch and the combine
        out = [CollectiveSpec("all_to_all", "dispatched tokens", calls * copies * d * 4, calls, ("ep",)),
               CollectiveSpec("all_to_all", "expert outputs", calls * copies * d * activation_bytes, calls, ("ep",)),
               CollectiveSpec("all_to_all", "expert counts", micro_steps * (layers + recomputed_blocks)
                              * model_cfg.n_experts * 8, micro_steps * (layers + recomputed_blocks), ("ep",))]
        if mesh.edp > 1:
            expert_numel = 3 * model_cfg.n_experts // mesh.ep * d * model_cfg.expert_d_ff * layers
            out.append(CollectiveSpec("all_reduce", "expert gradients", 4 * expert_numel, 1, ("edp",)))
        return out


def keep_experts(layer: MoEFeedForward, position: int, ep: int) -> None:
    """Replace `layer`'s (meta-device) expert weights by those of ep rank `position`: n_experts / ep of them."""
    n = layer.n_experts // ep
    layer.expert_slice = slice(position * n, (position + 1) * n)
    for name in ("w1", "w3", "w2"):
        full = getattr(layer, name)
        setattr(layer, name, nn.Parameter(full.new_empty((n, *full.shape[1:])), requires_grad=full.requires_grad))


def expert_box(model: nn.Module, fqn: str, value: Tensor) -> Optional[Boxed]:
    """`value` (parameter `fqn`, or optimizer state shaped like it) as this rank's box of the whole model's tensor
    when `fqn` is a routed-expert weight of which this rank holds n_experts / ep < n_experts: the box starts at the
    layer's first local expert. None for everything else (its local value is the whole model's)."""
    owner, _, leaf = fqn.rpartition(".")
    layer = model.get_submodule(owner) if owner else model
    if not isinstance(layer, MoEFeedForward) or leaf not in ("w1", "w3", "w2"):
        return None
    held = layer.expert_slice.stop - layer.expert_slice.start
    if held == layer.n_experts or value.shape != getattr(layer, leaf).shape:
        return None
    offset = (layer.expert_slice.start,) + (0,) * (value.dim() - 1)
    return Boxed((layer.n_experts, *value.shape[1:]), value.dtype, [(value, offset)])


def expert_layouts(model_cfg, ep: int) -> tuple[ModelLayout, ModelLayout]:
    """For the planner: one ep rank's parameter layout (its n_experts / ep experts per layer, everything else
    whole) and the same without the routed experts (what the data-parallel strategy broadcasts and reduces)."""
    from core.model import TransformerLM

    with torch.device("meta"):
        model = TransformerLM(model_cfg)
        layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
        for layer in layers:
            keep_experts(layer, 0, ep)
        local = ModelLayout.of(model)
        for layer in layers:
            for p in layer.expert_parameters():
                p.requires_grad_(False)  # ModelLayout counts trainable parameters only
        return local, ModelLayout.of(model)


class _LayerDispatch:
    """One MoE layer's `dispatcher`: the model's `ExpertDispatcher`, with or without the shared expert's overlap."""

    def __init__(self, dispatcher: ExpertDispatcher, overlap: bool) -> None:
        self.dispatcher, self.overlap = dispatcher, overlap

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        return self.dispatcher.group

    def __call__(self, xs: Tensor, counts: Tensor, experts: Callable[[Tensor, Tensor], Tensor],
                 shared: Optional[Callable[[], Tensor]] = None) -> tuple[Tensor, Optional[Tensor]]:
        if shared is not None and not self.overlap:
            out, _ = self.dispatcher(xs, counts, experts)
            return out, shared()
        return self.dispatcher(xs, counts, experts, shared)


def expert_parallel_degree(model: nn.Module) -> int:
    """ep of `model`'s MoE layers (1 when every expert is local)."""
    for m in model.modules():
        if isinstance(m, MoEFeedForward) and m.dispatcher is not None:
            return m.n_experts // (m.expert_slice.stop - m.expert_slice.start)
    return 1

