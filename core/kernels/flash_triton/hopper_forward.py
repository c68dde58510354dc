"""Hopper-specific (sm_90) FlashAttention forward in Gluon, warp-specialised in the manner of FlashAttention-3,
persistent, and the host code that decides where it applies and launches it.

Triton places a wait right after each asynchronous wgmma it issues, so its forward (`forward._fwd_kernel`)
cannot overlap the softmax of one key tile with the matmuls of another. Gluon places the waits where the results
are needed. A program stays on its SM (one per SM: shared memory holds no second) and walks query tiles of 128
rows (192 at d = 64, 80 and 96 from `FlashConfig.hopper_fwd_long_rows` rows: `WIDE_TILES`) of one (batch, head)
each, in three or four partitions (`gl.warp_specialize`):

- a producer (one warp with 64-key tiles, else a warpgroup: `producer_warps`) walks the schedule (`_tile`) and issues
  the TMA loads: the tile's 64-row Q blocks, one per consumer, into one of `Q_BUFS` buffers once the consumers have done
  their last Q K^T with it (a ready and an empty mbarrier each), with the tile's coordinates beside each block in shared
  memory, so the consumers do not walk the schedule's integer divisions themselves (`_post_tile`: 0.91-0.97x the time at
  S = 512-2048), and each key tile's K and V into rings of shared-memory slots, `STAGES` for V and as many or
  `K_STAGES` for K (a ready mbarrier per slot, and an empty one that the consumers release: with split rings a K slot
  after S = Q K^T, `_release_k`; with one ring K with V). The rings run on across query tiles, so the next tile's
  first loads overlap this tile's last matmuls and its epilogue (which a program-per-tile launch exposes on every tile:
  1.07-1.14x the time at 2048 rows);
- two (or three) consumer warpgroups, 64 query rows each (under a causal mask with 64-key tiles the two take alternate
  halves of their query tiles, `swap_halves`: the lower half's rows see one key tile fewer, which its consumer skips, so
  each gets the lighter half every second tile), with their own online-softmax state (base 2, log2(e) folded into the
  scale) and fp32 output accumulator in registers. Per key tile j a consumer issues S_j = Q K_j^T, then O += P_{j-1}
  V_{j-1} (P in registers as the wgmma A operand), waits for S_j only, computes the softmax of S_j (at d = 64 with two
  consumers over 128-key tiles an eighth of its exponentials by polynomial on the FMA units, `exp2_poly`), then waits
  for the PV matmul, releases slot j-1 and rescales O: at most two wgmma groups in flight. (ptxas moves that last wait
  above the softmax, so a consumer's PV matmul overlaps its own softmax only where the mask runs; kept below it, the
  wait measured slower: docs/attention.md, Tried.) A query tile's first key tile is peeled off that loop, or
  runs in it with a no-op PV (P = 0), by tile set and mask (`peel`). The consumers run unsynchronised, so one's
  softmax overlaps the others' matmuls; with two consumers and 128-key tiles at d = 80-128 (`pingpong`) they
  issue their matmul groups in turns (FlashAttention-3's ping-pong: an mbarrier a consumer, handed over once its group
  is issued), which keeps one's softmax under the other's matmuls rather than leaving it to chance. A tile's O / l goes
  into shared memory and out by one TMA store, which runs while the consumer stores the LSE and starts the next tile:
  from an O buffer of the consumer's own where shared memory has room (`_o_own`; the Q block goes back to the producer
  after the last S = Q K^T, and the store is waited on in the next epilogue), else from the tile's Q block buffer (the
  last S has read it), handed back to the producer once the store has read it, at the next tile's start. (Storing O from
  registers took 1.12-1.27x the time at S = 512-1024: scattered 4-byte stores, twice the L2 write sectors, where a
  short-row forward is bound by memory.) Consumers keep `CONSUMER_REGS` registers a thread (setmaxnreg), the producer
  `PRODUCER_REGS`.

The TMA descriptors are 4-D, over (Z, H, N, d) at the tensors' strides, made on the host (building 2-D per-head
ones in every program cost 20-25% at S = 512), so views such as q, k, v sliced from a fused projection are read in
place.

Head dims that are no power of two are tiled as a power-of-two main part and a tail (`common._TILE_D`: 80 = 64 +
16, 96 = 64 + 32; register and shared-memory tiles must be powers of two). Each part has its own TMA descriptors
(the tail's over the columns from 64 on) and shared-memory buffers; S = Q K^T is two wgmmas into one accumulator,
and O += P V one per part, the tail's accumulator beside the main one. At d = 128 (no tail) the tail's code is
compiled out. The narrow tail wgmmas cost about what the columns they skip save: at d = 96 the kernel takes about
as long as at 128 (so zero-padding to 128, not measured, might run level with it).

Causal masks are bottom-right aligned (query i sees keys j <= i + n_k - n_q); each consumer masks only its diagonal
and ragged-end tiles (and the first, peeled off the pipelined loop); three consumers skip the key tiles wholly
masked for their rows. Grouped-query attention: query head h reads KV head h // kv_group. Schedule (`_tile`): work
units are pairs of one head's query tiles, the r-th from the end with the r-th from the start, so under a causal
mask every unit has the same number of key tiles (an odd count's middle tiles go two heads to a unit), and program p
takes units p, p + grid, ... (head-major: the programs at work at one time share few heads' K and V in L2); under a
causal mask the last heads' tiles (`tail_heads`) follow, dealt singly, heaviest first, so the walks end level rather
than with a partial round of units. Outputs: O in its dtype (TMA: at strides a descriptor takes), and the
natural-log logsumexp (fp32, (Z*H, N_q); -inf and output 0 for a row that sees no key).

Scope (`fwd_applies`): compiled CUDA on sm_90, fp16 / bf16, head dims 64, 80, 96 and 128 (`HEAD_DIMS`), unit last
strides and 16-byte aligned bases and (batch, head, row) strides of Q, K and V (TMA). Everything else runs the
Triton kernels; `dispatch.flash_fwd_impl` takes this one wherever it applies and the call is not split (the
split-KV forward serves grids that leave SMs idle), with 64-key tiles below `FlashConfig.hopper_fwd_long_rows`
query rows under a causal mask (`SHORT_TILES`), three consumers at d = 64, 80 and 96 from there on (`WIDE_TILES`),
and at head dim 64 under a causal mask only from `FlashConfig.hopper_fwd_d64_min_rows` query rows on (at d = 64 the
exponentials, not the matmuls, bound it, and short causal rows leave little to overlap them with: at 512 rows it
took 0.95-0.98x the Triton forward's time with 128-key tiles, at 1024 0.97x; shorter rows keep the Triton forward,
not measured), its own row thresholds there (`fwd_tiles`).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from core.kernels.flash_triton import common, launch
from core.kernels.flash_triton.common import LOG2E, _cdiv

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait
    from core.kernels.flash_triton.hopper import _barrier, _tma_load  # under their 3.6 or 3.9 names
    from core.kernels.flash_triton.hopper import desc_fields, desc_over, part_descs
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global  # 3.9 renamed it
    HAVE_GLUON = True
except ImportError:  # a Triton without Gluon (or without its Hopper ops)
    HAVE_GLUON = False

# where it is faster than the Triton forward (docs/attention.md); at 64 under a causal mask from
# `FlashConfig.hopper_fwd_d64_min_rows` rows
HEAD_DIMS = (64, 80, 96, 128)
# query rows per consumer warpgroup; a program's query tile is `consumers` of them
HALF_M = 64
# (BLOCK_N keys per tile, STAGES of the V ring (and of the K ring), Q_BUFS query-tile buffers, consumer warpgroups[,
# K_STAGES: a shallower K ring]) per head dim, the fastest measured within the 227 KB of shared memory a program may
# have, with the consumers' O buffers where they fit (`_o_own`): d = 128, 2 x Q 32 KB + 2 x K 32 + 3 x V 32 = 224 KB
# (no O buffers). A K slot goes back after S = Q K^T, a step before its V slot, so two K slots keep the loads ahead;
# the slot saved holds a second Q buffer, loaded while the tile before runs, where with one ring of three (K, V)
# slots and one Q buffer a tile's Q load waited for the O store before it. Against that (one process, H100, the kernel
# alone, L2 flushed): 0.91x the time at (128, 16, 512) without the mask, 0.96x at (64, 16, 1024), 0.985x at (32, 16,
# 2048), level (0.99-1.01x) at 4096-16384; causal 0.95x at 2048, 0.985-0.99x at 8192-16384. d = 96, 2 x 24 + 3 x 48
# + O 24 = 216 KB; d = 80, 20 + 4 x 40 + 20 = 200 KB; d = 64 (its middle rows under a causal mask, 1024 to
# `FlashConfig.hopper_fwd_d64_long_rows`, and short rows without it), 2 x 16 + 5 x 32 + 16 = 208 KB
FWD_TILES = {64: (128, 5, 2, 2), 80: (128, 4, 1, 2), 96: (128, 3, 2, 2), 128: (128, 3, 2, 2, 2)}
# ... for short rows under a causal mask (`fwd_tiles`): 64-key tiles, so a row's few key tiles, the last one half
# masked, make more, smaller pipeline steps, and the two consumers take alternate halves of their query tiles and
# skip the key tiles wholly masked for their rows (`swap_halves`). Against 128-key tiles: 0.64-0.90x the time at
# S = 512-1024 at d = 80-128 (before the swap; 1.05-1.22x from 8192), at d = 64 0.93x at 512 rows, 1.04x at 1024 (its
# 64-key steps are short for their exponentials). The swap: 0.91-0.96x fixed halves' time at S = 512-1024.
# d = 128, 2 x 32 + 4 x 32 + O 32 = 224 KB; d = 96, 2 x 24 + 6 x 24 + 24 = 216 KB; d = 80, 2 x 20 + 8 x 20 + 20 =
# 220 KB; d = 64, 2 x 16 + 8 x 16 + 16 = 176 KB (eight stages took 0.98-0.99x eleven's time at 512 rows)
SHORT_TILES = {64: (64, 8, 2, 2), 80: (64, 8, 2, 2), 96: (64, 6, 2, 2), 128: (64, 4, 2, 2)}
# ... for long rows, where three consumers pay: at d = 64 the exponentials bound a consumer (a 64 x 128 score
# tile's 8192 exp2 take the SM's special-function units as long as its two wgmmas take the tensor cores), so a
# third consumer's matmuls fill the others' softmax time: 0.90-0.95x the time of two from 8192 rows, causal or not,
# level at 4096 with a causal mask; without it 0.89-0.97x at 1024-2048 rows (against two with `exp2_poly`), but
# 1.04-1.05x at 512, where the 192-row tiles leave a ragged end (FlashAttention-3 also runs three at d = 64).
# Q 24 + 5 x 32 + O 24 = 208 KB. At d = 80 and 96 three consumers with 64-key tiles (with 128-key ones their 160
# registers spill, 0.3-0.8 KB a thread): 0.87-0.92x two consumers' time from 2048 rows, causal or not (at S = 512
# 1.15-1.28x); d = 96, Q 36 + 6 x 24 + O 36 = 216 KB, d = 80, 30 + 6 x 20 + 30 = 180 KB. At d = 128 (4 stages) they
# measured 0.96-1.05x, so it keeps two.
WIDE_TILES = {64: (128, 5, 1, 3), 80: (64, 6, 1, 3), 96: (64, 6, 1, 3)}
# setmaxnreg, by consumer count: consumers 240 (two) or 160 (three) registers a thread, the producer 32
# (2 x 128 x 240 + 128 x 32 = 3 x 128 x 160 + 128 x 32 = 64 K; with 24 its tile arithmetic spills)
CONSUMER_REGS, PRODUCER_REGS = {2: 240, 3: 160}, 32
# head dims where two consumers with 128-key tiles issue their matmuls in turns (ping-pong, as FlashAttention-3):
# one consumer's softmax then runs while the other's matmuls do, instead of the two drifting into step. Against no
# turns (one process, H100): d = 128, 0.98x the time at 2048 rows causal, 0.95-0.96x without the mask, level
# (0.99-1.01x) at 8192-16384 causal; d = 96 0.93x and d = 80 0.96x on the rows these tiles serve there (under 2048
# without a mask). Not at d = 64, where the exponentials take as long as the matmuls (1.02-1.04x), nor with the
# 64-key short-row tiles (1.06-1.09x: the waits weigh on steps half as long)
PINGPONG_HEAD_DIMS = (80, 96, 128)
SMEM_LIMIT = 232448  # bytes of shared memory a program may have on sm_90
# how a consumer runs a query tile's first key tile, which has no PV matmul before it (`peel`)
IN_LOOP, PEEL_ONE_LOOP, PEEL_TWO_LOOPS = 0, 1, 2


def _exp2_asm() -> str:
    """PTX for exp2 of 8 values (inline asm, pack 8): seven by the special-function unit (MUFU.EX2, 16 a clock an SM,
    against the FMA units' 128), the eighth by a polynomial on the FMA units. 2^x = 2^j 2^f: j = round(x) by the
    1.5 * 2^23 trick (whose low bits are then j), f = x - j in [-0.5, 0.5], 2^f by a degree-3 minimax polynomial
    (relative error 1.0e-4, under bf16's and fp16's half ulp), j added to its exponent bits. x is clamped at -127
    first, so exp2(-inf) is exactly 0 (2^f = 1.0 has no mantissa bits)."""
    lines = ["{", ".reg .f32 %xc, %t, %j, %f, %q;", ".reg .b32 %qb, %e;"]
    lines += [f"ex2.approx.ftz.f32 ${i}, ${i + 8};" for i in range(7)]
    lines += ["max.ftz.f32 %xc, $15, 0fC2FE0000;",  # -127
              "add.rn.ftz.f32 %t, %xc, 0f4B400000;",  # + 1.5 * 2^23: round to an integer, kept in the low bits
              "sub.rn.ftz.f32 %j, %t, 0f4B400000;",
              "sub.rn.ftz.f32 %f, %xc, %j;",
              "fma.rn.ftz.f32 %q, %f, 0f3D6150EE, 0f3E78061A;",  # 0.0550088, 0.2422108
              "fma.rn.ftz.f32 %q, %q, %f, 0f3F317AFD;",  # 0.6932829
              "fma.rn.ftz.f32 %q, %q, %f, 0f3F800000;",  # 1
              "shl.b32 %e, %t, 23;",
              "mov.b32 %qb, %q;",
              "add.s32 $7, %qb, %e;", "}"]
    return "\n".join(lines)


if HAVE_GLUON:
    _HALF_M = gl.constexpr(HALF_M)
    _IN_LOOP, _PEEL_ONE_LOOP, _PEEL_TWO_LOOPS = gl.constexpr(IN_LOOP), gl.constexpr(PEEL_ONE_LOOP), \
        gl.constexpr(PEEL_TWO_LOOPS)
    _EXP2_ASM = gl.constexpr(_exp2_asm())
    _EXP2_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 8 + ["r"] * 8))

    @gluon.jit
    def _exp2(x, EXP_POLY: gl.constexpr):
        """exp2 of a float32 tile; with EXP_POLY one element of each 8 by a polynomial on the FMA units
        (`_exp2_asm`, `exp2_poly`)."""
        if EXP_POLY:
            return gl.inline_asm_elementwise(_EXP2_ASM, _EXP2_CONSTRAINTS, [x], dtype=gl.float32, is_pure=True,
                                             pack=8)
        else:
            return gl.exp2(x)

    @gluon.jit
    def _rounds(n_units):
        """The schedule's (rounds of pairs, tiles after them) (`_tile`): the units left over from full rounds go
        a tile a program where they fit in one round, else as one more round of pairs."""
        n_prog = gl.num_programs(0)
        full = n_units // n_prog
        n_rounds = gl.where(2 * (n_units - full * n_prog) <= n_prog, full, full + 1)
        return n_rounds, 2 * gl.maximum(n_units - n_rounds * n_prog, 0)

    @gluon.jit
    def _pair_walk(n_rounds, n_after):
        """How many tiles the program walks in units of pairs (`_tile`), from `_rounds`: two a round, then its one of
        the tiles after."""
        return 2 * n_rounds + (gl.program_id(0) < n_after).to(gl.int32)

    @gluon.jit
    def _walk_len(n_units, n_tail, n_tiles):
        """How many tiles the program walks (`_tile`): its units' tiles, then its share of the tail's, which are
        dealt round by round, every second round in reverse order of programs."""
        n_prog = gl.num_programs(0)
        tail = n_tail * n_tiles
        last = tail // n_prog  # the tail's last, partial round
        pos = gl.where(last % 2 == 0, gl.program_id(0), n_prog - 1 - gl.program_id(0))
        n_rounds, n_after = _rounds(n_units)
        return _pair_walk(n_rounds, n_after) + last + (pos < tail - last * n_prog).to(gl.int32)

    @gluon.jit
    def _post_tile(info, q_empty, slot, n_done, Q_BUFS: gl.constexpr, pid_zh, z, h, start_m):
        """Once its consumer has freed Q buffer slot `slot` (for the producer's n_done-th query tile), write the
        tile's (batch x head, batch, head, first row) into the slot's info words for the consumer (`_read_tile`); a
        first row of -1 says the walk is over. Every producer thread writes the same four words; the barrier orders
        them before the caller's q_ready arrive, which publishes them."""
        mbarrier.wait(q_empty.index(slot), ((n_done // Q_BUFS) & 1) ^ 1)
        lay: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
        i = gl.arange(0, 4, layout=lay)
        info.index(slot).store(gl.where(i == 0, pid_zh, gl.where(i == 1, z, gl.where(i == 2, h, start_m))))
        _barrier()

    @gluon.jit
    def _half(role, n_done, SWAP: gl.constexpr):
        """Which 64-row half of its n_done-th query tile consumer `role` takes: its own, or with SWAP (two
        consumers under a causal mask) the other one on every second tile, so each consumer gets the lower half,
        whose rows see one key tile fewer, on every second tile and the two do equal work."""
        if SWAP:
            return role ^ (n_done & 1)
        else:
            return role

    @gluon.jit
    def _key_bound(start_m, rows, causal_off, n_k, IS_CAUSAL: gl.constexpr):
        """Keys a query tile of `rows` rows from start_m sees: under the causal mask its last row's, j < start_m +
        rows + causal_off."""
        if IS_CAUSAL:
            return gl.minimum(gl.maximum(start_m + rows + causal_off, 0), n_k)
        else:
            return n_k

    @gluon.jit
    def _read_tile(info, slot):
        """A consumer's next query tile from info slot `slot` (`_post_tile`), once its q_ready has passed:
        (batch x head, batch, head, first row)."""
        lay: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
        t = info.index(slot).load(lay)
        i = gl.arange(0, 4, layout=lay)
        return (gl.sum(gl.where(i == 0, t, 0), 0), gl.sum(gl.where(i == 1, t, 0), 0),
                gl.sum(gl.where(i == 2, t, 0), 0), gl.sum(gl.where(i == 3, t, 0), 0))

    @gluon.jit
    def _tile(k, n_units, n_pairs, n_tiles, n_zh, n_tail, n_heads, kv_group, n_k, causal_off,
              IS_CAUSAL: gl.constexpr, BM: gl.constexpr, BLOCK_N: gl.constexpr):
        """The program's k-th query tile: (whether it exists, batch x head, batch, head, KV head, first row, key
        bound, key tiles). Work units are pairs of one head's query tiles, the r-th from the end and the r-th from
        the start (n_pairs = n_tiles // 2 of them a head): under a causal mask a pair's key tiles add up to the same
        count for every r. With an odd tile count each head's middle tile is left over, about half a pair's work;
        two heads' middle tiles make one more unit, after the two heads' pairs (head-major: the programs at work at
        one time share few heads' K and V in L2; a head's lone middle tile as a unit of its own left every program
        that drew one half idle, 1.3x the time at 3 tiles a head). Programs take units program, program +
        programs, ... in rounds, so they get equal work. Units left over from the full rounds go a tile a program
        where they fit (fewer than half the programs: tiles about half as heavy as a unit), else as a last, partial
        round of units.
        Under a causal mask the last n_tail heads (`tail_heads`) are no units: the units of the heads before fill
        whole rounds, and the tail's tiles follow, heaviest first (the r-th from the end of every tail head, r = 0,
        1, ...), dealt a tile a program a round, every second round in reverse order of programs, so the heavy tiles
        and the light ones even out and the walk ends with the lightest. (Units alone end with a partial round: at
        2048 rows 8 programs run tiles of up to 12 key tiles while the rest idle, 2.2% over the mean walk.)"""
        n_prog = gl.num_programs(0)
        n_zh_units = n_zh - n_tail  # heads in units
        n_rounds, n_after = _rounds(n_units)
        in_rounds = (k < 2 * n_rounds).to(gl.int32)
        after = gl.program_id(0) + n_rounds * n_prog * 2  # the program's tile after the rounds, as a unit's half
        u = in_rounds * (gl.program_id(0) + (k // 2) * n_prog) + (1 - in_rounds) * (after // 2)
        second = in_rounds * (k % 2) + (1 - in_rounds) * (after % 2)  # the unit's second, lighter tile
        odd = n_tiles % 2
        blk_units = 2 * n_pairs + odd  # units of two heads: their pairs, then their middle tiles
        blk = u // blk_units
        r_blk = u % blk_units
        pair_units = gl.minimum(n_zh_units - 2 * blk, 2) * n_pairs  # (one head in the last block of an odd count)
        middle = (r_blk >= pair_units).to(gl.int32)
        pid_zh = 2 * blk + middle * second + (1 - middle) * (r_blk // gl.maximum(n_pairs, 1))
        p = r_blk % gl.maximum(n_pairs, 1)
        r = (1 - middle) * (p + second * (n_tiles - 1 - 2 * p)) + middle * n_pairs  # query tiles from the end
        exists = (u < n_units) & (pid_zh < n_zh_units)
        # the tail's i-th tile, dealt in round j
        j = k - _pair_walk(n_rounds, n_after)
        i = j * n_prog + gl.where(j % 2 == 0, gl.program_id(0), n_prog - 1 - gl.program_id(0))
        in_tail = j >= 0
        pid_zh = gl.where(in_tail, n_zh_units + i % gl.maximum(n_tail, 1), pid_zh)
        r = gl.where(in_tail, i // gl.maximum(n_tail, 1), r)
        exists = exists | in_tail
        start_m = (n_tiles - 1 - r) * BM
        off_z = pid_zh // n_heads
        off_h = pid_zh % n_heads
        hi = _key_bound(start_m, BM, causal_off, n_k, IS_CAUSAL)
        return exists, pid_zh, off_z, off_h, off_h // kv_group, start_m, hi, gl.cdiv(hi, BLOCK_N)

    @gluon.jit
    def _tile_load(desc, tail_desc, z, h, row, bar, dst, tail_dst, D_TAIL: gl.constexpr):
        """TMA loads of rows row ... of head (z, h), through 4-D descriptors over (Z, H, N, d): the head dim's
        main part into dst and, where it has one, its tail into tail_dst (rows past the head's end read as
        zeros)."""
        _tma_load(desc, [z, h, row, 0], bar, dst.reshape([1, 1, dst.shape[0], dst.shape[1]]))
        if D_TAIL > 0:
            _tma_load(tail_desc, [z, h, row, 0], bar, tail_dst.reshape([1, 1, tail_dst.shape[0], tail_dst.shape[1]]))

    @gluon.jit
    def _tile_store(desc, tail_desc, z, h, row, src, tail_src, D_TAIL: gl.constexpr):
        """TMA stores of src (and, where the head dim has one, its tail) to rows row ... of head (z, h) (rows past
        the head's end are not written)."""
        _tma_store(desc, [z, h, row, 0], src.reshape([1, 1, src.shape[0], src.shape[1]]))
        if D_TAIL > 0:
            _tma_store(tail_desc, [z, h, row, 0], tail_src.reshape([1, 1, tail_src.shape[0], tail_src.shape[1]]))

    @gluon.jit
    def _load_kv(it, row, k_desc, v_desc, kt_desc, vt_desc, k_smem, v_smem, kt_smem, vt_smem, k_ready, v_ready,
                 k_empty, v_empty, z, h, kv_bytes: gl.constexpr, K_STAGES: gl.constexpr, STAGES: gl.constexpr,
                 D_TAIL: gl.constexpr):
        """The key tile from row `row` of K into slot it % K_STAGES of the K ring and of V into slot it % STAGES
        of the V ring (`it` counts the program's key tiles over all its query tiles), each once every consumer
        released the tile before in that slot (`_release_k`; a fresh mbarrier passes the wait on phase 1)."""
        ks = it % K_STAGES
        vs = it % STAGES
        if K_STAGES != STAGES:
            mbarrier.wait(k_empty.index(ks), ((it // K_STAGES) & 1) ^ 1)
        else:  # one ring: a slot's K and V go back together
            mbarrier.wait(v_empty.index(vs), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(ks), kv_bytes)
        _tile_load(k_desc, kt_desc, z, h, row, k_ready.index(ks), k_smem.index(ks), kt_smem.index(ks), D_TAIL)
        if K_STAGES != STAGES:
            mbarrier.wait(v_empty.index(vs), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(v_ready.index(vs), kv_bytes)
        _tile_load(v_desc, vt_desc, z, h, row, v_ready.index(vs), v_smem.index(vs), vt_smem.index(vs), D_TAIL)

    @gluon.jit
    def _release_k(k_empty, slot, K_STAGES: gl.constexpr, STAGES: gl.constexpr):
        """A consumer's S = Q K^T has read K slot `slot`: with split rings (K_STAGES != STAGES) the slot goes back to
        the producer now, a step before its key tile's V slot; with one ring K goes back with V (`v_empty`), after
        the PV matmul."""
        if K_STAGES != STAGES:
            mbarrier.arrive(k_empty.index(slot), count=1)

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, qt_desc, kt_desc, vt_desc, q_smem, k_smem, v_smem, qt_smem, kt_smem,
                  vt_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, info, n_units, n_pairs, n_tiles,
                  n_zh, n_tail, n_heads, kv_group, n_k, causal_off, IS_CAUSAL: gl.constexpr, D_MAIN: gl.constexpr,
                  D_TAIL: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, STAGES: gl.constexpr,
                  Q_BUFS: gl.constexpr, NUM_CONS: gl.constexpr,
                  SWAP: gl.constexpr):
        """TMA loads of the program's query tiles one after the other: a tile's K_0 / V_0, its Q blocks once
        the consumers are done with the Q buffer (Q_BUFS of them in turn), each with the tile's coordinates in
        that Q block's info slot (`_post_tile`), then K_i / V_i of its other key tiles through the ring. So the
        next tile's loads run while the consumers finish this one. Rows past a head's end read as zeros. After the
        last tile each consumer's next info slot gets first row -1, which ends its walk."""
        elem: gl.constexpr = q_smem.dtype.primitive_bitwidth // 8
        q_bytes: gl.constexpr = _HALF_M * (D_MAIN + D_TAIL) * elem
        kv_bytes: gl.constexpr = BLOCK_N * (D_MAIN + D_TAIL) * elem
        it = 0  # key tiles loaded
        n_done = 0  # query tiles loaded
        for k in range(0, _walk_len(n_units, n_tail, n_tiles)):
            exists, pid_zh, z, h, hk, start_m, hi, n_kt = _tile(k, n_units, n_pairs, n_tiles, n_zh, n_tail, n_heads,
                                                                kv_group, n_k, causal_off, IS_CAUSAL,
                                                                NUM_CONS * _HALF_M, BLOCK_N)
            if exists:
                if n_kt > 0:
                    _load_kv(it, 0, k_desc, v_desc, kt_desc, vt_desc, k_smem, v_smem, kt_smem, vt_smem, k_ready,
                             v_ready, k_empty, v_empty, z, hk, kv_bytes, K_STAGES, STAGES, D_TAIL)
                qb = (n_done % Q_BUFS) * NUM_CONS
                for c in gl.static_range(NUM_CONS):
                    _post_tile(info, q_empty, qb + c, n_done, Q_BUFS, pid_zh, z, h, start_m)
                    mbarrier.expect(q_ready.index(qb + c), q_bytes)
                    _tile_load(q_desc, qt_desc, z, h, start_m + _half(c, n_done, SWAP) * _HALF_M,
                               q_ready.index(qb + c), q_smem.index(qb + c), qt_smem.index(qb + c), D_TAIL)
                for i in range(1, n_kt):
                    _load_kv(it + i, i * BLOCK_N, k_desc, v_desc, kt_desc, vt_desc, k_smem, v_smem, kt_smem,
                             vt_smem, k_ready, v_ready, k_empty, v_empty, z, hk, kv_bytes, K_STAGES, STAGES,
                             D_TAIL)
                it += n_kt
                n_done += 1
        qb = (n_done % Q_BUFS) * NUM_CONS
        for c in gl.static_range(NUM_CONS):
            _post_tile(info, q_empty, qb + c, n_done, Q_BUFS, 0, 0, 0, -1)
            mbarrier.arrive(q_ready.index(qb + c), count=1)

    @gluon.jit
    def _mask(s, offs_m, offs_n, n_k, causal_off, IS_CAUSAL: gl.constexpr):
        """Scores of keys past n_k, and under the causal mask of keys past a row's last visible one, set to -inf."""
        if IS_CAUSAL:
            # a row's last visible key, once per row: one comparison an element instead of two
            last = gl.minimum(offs_m + causal_off, n_k - 1)
            valid = gl.expand_dims(offs_n, 0) <= gl.expand_dims(last, 1)
        else:
            valid = gl.expand_dims(offs_n, 0) < n_k
        return gl.where(valid, s, float("-inf"))

    @gluon.jit
    def _softmax(s, m_i, l_i, qk_scale, MASKED: gl.constexpr, EXP_POLY: gl.constexpr):
        """One key tile's online-softmax update from scores s (masked with MASKED: rows may have no key yet):
        (p, alpha, m, l), base 2; m in scaled units (max(s) * scale == max(s * scale) exactly, so the scale folds into
        the exponent's FMA)."""
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        if MASKED:
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        else:
            m_use = m_new
        p = _exp2(s * qk_scale - gl.expand_dims(m_use, 1), EXP_POLY)
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _scores(q_tile, qt_tile, stage, k_smem, kt_smem, zero_s, D_TAIL: gl.constexpr):
        """Issue S = Q K^T of ring slot `stage` (the head dim's tail a second wgmma into the same accumulator)."""
        s = warpgroup_mma(q_tile, k_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        if D_TAIL > 0:
            s = warpgroup_mma(qt_tile, kt_smem.index(stage).permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _pv(p_op, stage, v_smem, vt_smem, o, ot, D_TAIL: gl.constexpr):
        """Issue O += P V of ring slot `stage`, for the head dim's main part and, where it has one, its tail."""
        o = warpgroup_mma(p_op, v_smem.index(stage), o, is_async=True)
        if D_TAIL > 0:
            ot = warpgroup_mma(p_op, vt_smem.index(stage), ot, is_async=True)
        return o, ot

    @gluon.jit
    def _pv_wait(o, ot, p_op, D_TAIL: gl.constexpr):
        """Wait for every wgmma in flight (the PV matmuls last): (O, O tail, P)."""
        if D_TAIL > 0:
            o, ot, p_op = warpgroup_mma_wait(0, deps=[o, ot, p_op])
        else:
            o, p_op = warpgroup_mma_wait(0, deps=[o, p_op])
        return o, ot, p_op

    @gluon.jit
    def _my_turn(turn, g, ROLE: gl.constexpr, PINGPONG: gl.constexpr):
        """With PINGPONG, wait for this consumer's g-th turn: consumer 1's once consumer 0 has issued its g-th group
        of matmuls, consumer 0's once consumer 1 has issued its (g-1)-th (the first is pre-arrived)."""
        if PINGPONG:
            mbarrier.wait(turn.index(ROLE), g & 1)

    @gluon.jit
    def _hand_over(turn, ROLE: gl.constexpr, PINGPONG: gl.constexpr):
        """With PINGPONG, the other consumer's turn: this one's matmuls are issued."""
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - ROLE), count=1)

    @gluon.jit
    def _steps(it, start, end, mask_from, q_tile, qt_tile, k_smem, v_smem, kt_smem, vt_smem, k_ready, v_ready,
               k_empty, v_empty, o, ot, m_i, l_i, p_op, offs_m, offs_n0, n_k, causal_off, qk_scale,
               MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr, D_TAIL: gl.constexpr, BLOCK_N: gl.constexpr,
               K_STAGES: gl.constexpr, STAGES: gl.constexpr, mma_s: gl.constexpr, mma_o: gl.constexpr,
               mma_t: gl.constexpr, turn, g0, ROLE: gl.constexpr,
               PINGPONG: gl.constexpr, PEEL: gl.constexpr, EXP_POLY: gl.constexpr):
        """Key tiles [start, end) (the program's key tile `it` first): issue S_j, issue O += P_{j-1} V_{j-1}, wait
        for S_j and release K_j's slot, softmax of S_j under the PV matmul, wait for it, release V_{j-1}'s slot,
        rescale O. Returns P_j for the next.
        With PINGPONG the two matmuls are issued in turns with the other consumer (this one's group g0 + it).
        PEEL (`peel`): with IN_LOOP the loop runs a query tile's every key tile, the first one's PV multiplying its
        own V tile by P = 0 (p_op comes in as zeros; a no-op, which keeps one copy of the step's code); with IN_LOOP
        or PEEL_ONE_LOOP the softmax is masked from key mask_from on (the mask behind a branch); with PEEL_TWO_LOOPS
        every step's softmax is MASKED or not."""
        dtype: gl.constexpr = q_tile.dtype
        # wgmma groups the PV matmuls leave in flight while S_j is awaited: one per head-dim part
        PV_GROUPS: gl.constexpr = 2 if D_TAIL > 0 else 1
        zero_s = gl.zeros([_HALF_M, BLOCK_N], gl.float32, layout=mma_s)
        for start_n in range(start, end, BLOCK_N):
            stage = it % K_STAGES
            pv_it = it - 1  # the key tile whose PV this step issues
            if PEEL == _IN_LOOP:
                pv_it += (start_n == 0).to(gl.int32)
            prev = pv_it % STAGES
            mbarrier.wait(k_ready.index(stage), (it // K_STAGES) & 1)
            if PINGPONG:  # both operands' tiles in before the turn is taken, so the turn's two issues run back to back
                mbarrier.wait(v_ready.index(prev), (pv_it // STAGES) & 1)
                _my_turn(turn, g0 + it, ROLE, PINGPONG)
            s = _scores(q_tile, qt_tile, stage, k_smem, kt_smem, zero_s, D_TAIL)
            if not PINGPONG:  # S_j runs while V_{j-1} may still be on its way
                mbarrier.wait(v_ready.index(prev), (pv_it // STAGES) & 1)
            o, ot = _pv(p_op, prev, v_smem, vt_smem, o, ot, D_TAIL)
            _hand_over(turn, ROLE, PINGPONG)
            s = warpgroup_mma_wait(PV_GROUPS, deps=[s])
            _release_k(k_empty, stage, K_STAGES, STAGES)
            if PEEL != _PEEL_TWO_LOOPS:
                # only the mask is branched on: one copy of the softmax's code, not a masked and a full one, which
                # the instruction cache holds better
                if start_n >= mask_from:
                    s = _mask(s, offs_m, start_n + offs_n0, n_k, causal_off, IS_CAUSAL)
                p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, True, EXP_POLY)
            else:
                if MASKED:
                    s = _mask(s, offs_m, start_n + offs_n0, n_k, causal_off, IS_CAUSAL)
                p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, MASKED, EXP_POLY)
            o, ot, p_op = _pv_wait(o, ot, p_op, D_TAIL)
            # (a first step's V slot is released after the tile's next PV has read it)
            mbarrier.arrive(v_empty.index(prev), count=1, pred=(start_n > 0) | (PEEL != _IN_LOOP))
            o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, mma_o)), 1)
            if D_TAIL > 0:
                ot = ot * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, mma_t)), 1)
            p_op = gl.convert_layout(p.to(dtype), gl.DotOperandLayout(0, mma_o, 2))
            it += 1
        return it, o, ot, m_i, l_i, p_op

    @gluon.jit
    def _attend(it, row0, hi, q_tile, qt_tile, q_empty, k_smem, v_smem, kt_smem, vt_smem, k_ready, v_ready,
                k_empty, v_empty, n_k, causal_off, qk_scale, IS_CAUSAL: gl.constexpr, D_MAIN: gl.constexpr,
                D_TAIL: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, STAGES: gl.constexpr,
                O_OWN: gl.constexpr, mma_s: gl.constexpr,
                mma_o: gl.constexpr, mma_t: gl.constexpr, turn, g0, ROLE: gl.constexpr, PINGPONG: gl.constexpr,
                PEEL: gl.constexpr, EXP_POLY: gl.constexpr):
        """Online softmax of the 64 rows from row0 over keys [0, hi) (at least one key tile), from ring slot `it`,
        with O_OWN releasing the Q block (q_empty) once the last S = Q K^T is done: (it after the last tile, O
        unnormalised (main part, tail), m, l). With PINGPONG each group of matmuls is issued in turn with the
        other consumer: a tile of n key tiles makes n + 1 groups (S_0 (IN_LOOP: with a no-op PV); S_j with
        P_{j-1} V_{j-1}; the last PV), the first of them this consumer's group g0 + it. Key tile 0 has no PV to
        overlap (`peel`): with IN_LOOP it runs in the loop all the same (`_steps`), else it is peeled off the loop,
        and the other key tiles run in one loop (PEEL_ONE_LOOP: two copies of the softmax's code) or the full and the
        masked ones in a loop each (PEEL_TWO_LOOPS: three copies)."""
        dtype: gl.constexpr = q_tile.dtype
        offs_m = row0 + gl.arange(0, _HALF_M, layout=gl.SliceLayout(1, mma_s))
        offs_n0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_s))
        m_i = gl.full([_HALF_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma_s))
        l_i = gl.zeros([_HALF_M], gl.float32, layout=gl.SliceLayout(1, mma_s))
        o = gl.zeros([_HALF_M, D_MAIN], gl.float32, layout=mma_o)
        ot = gl.zeros([_HALF_M, D_TAIL if D_TAIL > 0 else 16], gl.float32, layout=mma_t)
        n_full = (n_k // BLOCK_N) * BLOCK_N  # key tiles without a ragged end
        if IS_CAUSAL:  # key tiles every row of this warpgroup sees whole: j < first row + causal_off + 1
            full_hi = gl.minimum((gl.maximum(row0 + causal_off + 1, 0) // BLOCK_N) * BLOCK_N, n_full)
        else:
            full_hi = n_full
        if PEEL == _IN_LOOP:
            p_op = gl.zeros([_HALF_M, BLOCK_N], dtype, layout=gl.DotOperandLayout(0, mma_o, 2))
            it, o, ot, m_i, l_i, p_op = _steps(it, 0, hi, full_hi, q_tile, qt_tile, k_smem, v_smem, kt_smem,
                                               vt_smem, k_ready, v_ready, k_empty, v_empty, o, ot, m_i, l_i, p_op,
                                               offs_m, offs_n0, n_k, causal_off, qk_scale, False, IS_CAUSAL, D_TAIL,
                                               BLOCK_N, K_STAGES, STAGES, mma_s, mma_o, mma_t, turn, g0, ROLE, PINGPONG,
                                               PEEL,
                                               EXP_POLY)
        else:
            # key tile 0, peeled off the loop (no PV matmul to overlap yet), masked
            stage = it % K_STAGES
            mbarrier.wait(k_ready.index(stage), (it // K_STAGES) & 1)
            zero_s = gl.zeros([_HALF_M, BLOCK_N], gl.float32, layout=mma_s)
            _my_turn(turn, g0 + it, ROLE, PINGPONG)
            s = _scores(q_tile, qt_tile, stage, k_smem, kt_smem, zero_s, D_TAIL)
            _hand_over(turn, ROLE, PINGPONG)
            s = warpgroup_mma_wait(0, deps=[s])
            _release_k(k_empty, stage, K_STAGES, STAGES)
            s = _mask(s, offs_m, offs_n0, n_k, causal_off, IS_CAUSAL)
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, True, EXP_POLY)
            p_op = gl.convert_layout(p.to(dtype), gl.DotOperandLayout(0, mma_o, 2))
            it += 1
            if PEEL == _PEEL_ONE_LOOP:  # the other key tiles in one loop, the mask behind its branch
                it, o, ot, m_i, l_i, p_op = _steps(it, BLOCK_N, hi, full_hi, q_tile, qt_tile, k_smem, v_smem,
                                                   kt_smem, vt_smem, k_ready, v_ready, k_empty, v_empty, o, ot, m_i,
                                                   l_i, p_op, offs_m, offs_n0, n_k, causal_off, qk_scale, False,
                                                   IS_CAUSAL, D_TAIL, BLOCK_N, K_STAGES, STAGES, mma_s, mma_o, mma_t,
                                                   turn, g0, ROLE, PINGPONG, PEEL, EXP_POLY)
            else:  # a loop over the full key tiles, one over the masked ones
                it, o, ot, m_i, l_i, p_op = _steps(it, BLOCK_N, full_hi, 0, q_tile, qt_tile, k_smem, v_smem,
                                                   kt_smem, vt_smem, k_ready, v_ready, k_empty, v_empty, o, ot, m_i,
                                                   l_i, p_op, offs_m, offs_n0, n_k, causal_off, qk_scale, False,
                                                   IS_CAUSAL, D_TAIL, BLOCK_N, K_STAGES, STAGES, mma_s, mma_o, mma_t,
                                                   turn, g0, ROLE, PINGPONG, PEEL, EXP_POLY)
                it, o, ot, m_i, l_i, p_op = _steps(it, gl.maximum(full_hi, BLOCK_N), hi, 0, q_tile, qt_tile, k_smem,
                                                   v_smem, kt_smem, vt_smem, k_ready, v_ready, k_empty, v_empty, o,
                                                   ot, m_i, l_i, p_op, offs_m, offs_n0, n_k, causal_off, qk_scale,
                                                   True, IS_CAUSAL, D_TAIL, BLOCK_N, K_STAGES, STAGES, mma_s, mma_o,
                                                   mma_t, turn, g0, ROLE, PINGPONG, PEEL, EXP_POLY)
        if O_OWN:  # the producer may load the next tile's Q while the last PV runs
            mbarrier.arrive(q_empty, count=1)
        # the last key tile's PV
        prev = (it - 1) % STAGES
        mbarrier.wait(v_ready.index(prev), ((it - 1) // STAGES) & 1)
        _my_turn(turn, g0 + it, ROLE, PINGPONG)
        o, ot = _pv(p_op, prev, v_smem, vt_smem, o, ot, D_TAIL)
        _hand_over(turn, ROLE, PINGPONG)
        o, ot, p_op = _pv_wait(o, ot, p_op, D_TAIL)
        mbarrier.arrive(v_empty.index(prev), count=1)
        return it, o, ot, m_i, l_i

    @gluon.jit
    def _rcp_approx(x):
        """1 / x by the special-function unit alone (within 1 ulp): the epilogue's division, once a tile, without the
        range fix-ups of `1.0 / x` (l >= 1 here, a row's largest term being exp2(0))."""
        return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _lg2_approx(x):
        """log2(x) by the special-function unit (within 2^-22 relative; -inf at 0), not libdevice's polynomial."""
        return gl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _next_tile(n_done, info, q_ready, q_empty, ROLE: gl.constexpr, Q_BUFS: gl.constexpr,
                   NUM_CONS: gl.constexpr, O_OWN: gl.constexpr):
        """A consumer's next query tile, once its Q block is in: (batch x head, batch, head, first row; -1 when
        the walk is over), as the producer computed it (`_post_tile`: a consumer that computed `_tile` itself spent
        a tenth of its instructions at S = 512 on the schedule's integer divisions). Without O_OWN the previous
        tile's Q buffer first goes back to the producer, once its O store has read it (with one buffer the producer
        loads this tile's Q block into it)."""
        if (not O_OWN) & (n_done > 0):
            tma.store_wait(0)
            _barrier()  # (the wait is the issuing thread's: the others wait for it here)
            mbarrier.arrive(q_empty.index(((n_done - 1) % Q_BUFS) * NUM_CONS + ROLE), count=1)
        qb = (n_done % Q_BUFS) * NUM_CONS + ROLE
        mbarrier.wait(q_ready.index(qb), (n_done // Q_BUFS) & 1)
        return _read_tile(info, qb)

    @gluon.jit
    def _consumer(ROLE: gl.constexpr, O, O_T, LSE, q_smem, k_smem, v_smem, qt_smem, kt_smem, vt_smem, o_smem,
                  ot_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, info, n_q, n_k, causal_off,
                  qk_scale, IS_CAUSAL: gl.constexpr, D_MAIN: gl.constexpr, D_TAIL: gl.constexpr,
                  BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, STAGES: gl.constexpr, Q_BUFS: gl.constexpr,
                  O_OWN: gl.constexpr, NUM_CONS: gl.constexpr, PINGPONG: gl.constexpr, PEEL: gl.constexpr,
                  SWAP: gl.constexpr, EXP_POLY: gl.constexpr):
        """Rows ROLE * 64 ... of each of the program's query tiles: attention over the tile's key tiles, then O
        (by TMA, from this warpgroup's O buffer with O_OWN, else from the tile's Q buffer) and the LSE stored."""
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, D_MAIN, 16])
        # the head dim's tail (16 columns when it has none: a placeholder the compiler removes)
        D_T: gl.constexpr = D_TAIL if D_TAIL > 0 else 16
        mma_t: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, D_T, 16])
        row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
        row_o: gl.constexpr = gl.SliceLayout(1, mma_o)
        dtype: gl.constexpr = q_smem.dtype
        # three consumers' 192-row tiles end ragged at power-of-two lengths, and under a causal mask their first
        # rows miss the diagonal's last key tile: each consumer computes only the key tiles its rows see; so do two
        # with swapped halves (with fixed halves skipping measured level with computing them all: the upper half's
        # consumer, which sees every key tile, sets the pace)
        SKIP: gl.constexpr = (NUM_CONS > 2) | SWAP
        it = 0  # key tiles consumed
        n_done = 0  # query tiles consumed
        n_seen = 0  # query tiles with keys to attend to (the ping-pong turns: n + 1 per tile of n key tiles)
        pid_zh, off_z, off_h, start_m = _next_tile(n_done, info, q_ready, q_empty, ROLE, Q_BUFS, NUM_CONS, O_OWN)
        while start_m >= 0:
            qb = (n_done % Q_BUFS) * NUM_CONS + ROLE
            row0 = start_m + _half(ROLE, n_done, SWAP) * _HALF_M
            hi = _key_bound(start_m, NUM_CONS * _HALF_M, causal_off, n_k, IS_CAUSAL)
            n_kt = gl.cdiv(hi, BLOCK_N)
            if O_OWN:
                o_buf = o_smem.index(ROLE)
                ot_buf = ot_smem.index(ROLE)
            else:
                o_buf = q_smem.index(qb)
                ot_buf = qt_smem.index(qb)
            # with SKIP, the key tiles this warpgroup's rows see (none past n_q: a ragged last tile's rows) of
            # the tile's n_kt; the others it only releases, below
            my_hi = hi
            if SKIP:
                if IS_CAUSAL:
                    my_hi = gl.minimum(gl.maximum(row0 + _HALF_M + causal_off, 0), hi)
                my_hi = gl.where(row0 < n_q, my_hi, 0)
            my_kt = gl.cdiv(my_hi, BLOCK_N)
            if my_kt > 0:
                it, o, ot, m_i, l_i = _attend(it, row0, my_hi, q_smem.index(qb), qt_smem.index(qb),
                                              q_empty.index(qb), k_smem, v_smem, kt_smem, vt_smem, k_ready, v_ready,
                                              k_empty, v_empty, n_k, causal_off, qk_scale, IS_CAUSAL, D_MAIN, D_TAIL,
                                              BLOCK_N, K_STAGES, STAGES, O_OWN, mma_s, mma_o, mma_t, turn, n_seen, ROLE,
                                              PINGPONG, PEEL, EXP_POLY)
                n_seen += 1
            else:  # rows past n_q, or causal with n_q > n_k + the rows: no key visible
                if O_OWN:
                    mbarrier.arrive(q_empty.index(qb), count=1)
                m_i = gl.full([_HALF_M], float("-inf"), gl.float32, layout=row_s)
                l_i = gl.zeros([_HALF_M], gl.float32, layout=row_s)
                o = gl.zeros([_HALF_M, D_MAIN], gl.float32, layout=mma_o)
                ot = gl.zeros([_HALF_M, D_T], gl.float32, layout=mma_t)
            if SKIP:
                # key tiles wholly masked for these rows: released as soon as loaded (their scores would add
                # exp2(-inf) = 0 and leave m unchanged), not computed
                for j in range(my_kt, n_kt):
                    mbarrier.wait(k_ready.index(it % K_STAGES), (it // K_STAGES) & 1)
                    mbarrier.wait(v_ready.index(it % STAGES), (it // STAGES) & 1)
                    _release_k(k_empty, it % K_STAGES, K_STAGES, STAGES)
                    mbarrier.arrive(v_empty.index(it % STAGES), count=1)
                    it += 1
            # epilogue: O = acc / l into the O buffer (with O_OWN once the previous tile's store has read it;
            # else the Q buffer, whose last reader, the last S = Q K^T, is done), stored by the TMA engine (rows
            # past n_q clipped) while this warpgroup goes on; LSE natural-log
            inv_l = _rcp_approx(gl.where(l_i == 0.0, 1.0, l_i))
            if O_OWN:
                tma.store_wait(0)
                _barrier()
            o_buf.store((o * gl.expand_dims(gl.convert_layout(inv_l, row_o), 1)).to(dtype))
            if D_TAIL > 0:
                ot_buf.store((ot * gl.expand_dims(gl.convert_layout(inv_l, gl.SliceLayout(1, mma_t)), 1))
                             .to(dtype))
            fence_async_shared()
            _barrier()  # every warp's part of O is in shared memory before one thread issues the store
            _tile_store(O, O_T, off_z, off_h, row0, o_buf, ot_buf, D_TAIL)
            offs_m = row0 + gl.arange(0, _HALF_M, layout=row_s)
            lse = (m_i + _lg2_approx(l_i)) * 0.6931471805599453
            gl.store(LSE + pid_zh.to(gl.int64) * n_q + offs_m, lse, mask=offs_m < n_q)
            n_done += 1
            pid_zh, off_z, off_h, start_m = _next_tile(n_done, info, q_ready, q_empty, ROLE, Q_BUFS, NUM_CONS, O_OWN)
        tma.store_wait(0)  # the last O has left shared memory before the program ends

    @gluon.jit
    def _fwd_ws_kernel(Q, K, V, O, Q_T, K_T, V_T, O_T, LSE,  # Q, K, V, O (tails Q_T, ... or None): 4-D TMA descriptors
                       n_heads, kv_group, n_q, n_k, causal_off, qk_scale, n_zh, n_tail,
                       IS_CAUSAL: gl.constexpr, D_MAIN: gl.constexpr, D_TAIL: gl.constexpr, BLOCK_N: gl.constexpr,
                       K_STAGES: gl.constexpr, STAGES: gl.constexpr, Q_BUFS: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr,
                       PRODUCER_REGS: gl.constexpr, PRODUCER_WARPS: gl.constexpr, O_OWN: gl.constexpr,
                       NUM_CONS: gl.constexpr, PINGPONG: gl.constexpr, PEEL: gl.constexpr, SWAP: gl.constexpr,
                       EXP_POLY: gl.constexpr):
        gl.static_assert(gl.num_warps() == 4, "the default partition is one consumer warpgroup")
        gl.static_assert(NUM_CONS == 2 or not PINGPONG, "ping-pong turns are between two consumers")
        gl.static_assert(not (SWAP and PINGPONG), "ping-pong turns count equal matmul groups a consumer")
        gl.static_assert(NUM_CONS == 2 or not SWAP, "halves are swapped between two consumers")
        # persistent: the program walks pairs of query tiles of 2 x 64 rows (`_tile`), head-major
        n_tiles = gl.cdiv(n_q, NUM_CONS * _HALF_M)
        n_pairs = n_tiles // 2  # pairs of query tiles a head, and two heads' middle tiles a unit (`_tile`)
        n_zh_units = n_zh - n_tail  # the heads before the tail (`tail_heads`)
        n_units = (n_zh_units // 2) * (2 * n_pairs + n_tiles % 2) + (n_zh_units % 2) * (n_pairs + n_tiles % 2)
        dtype: gl.constexpr = Q.dtype
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_HALF_M, D_MAIN], dtype)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_MAIN], dtype)
        # Q_BUFS buffers of the two consumers' Q blocks (buffer b, consumer c at index 2 b + c)
        q_smem = gl.allocate_shared_memory(dtype, [NUM_CONS * Q_BUFS, _HALF_M, D_MAIN], q_layout)
        k_smem = gl.allocate_shared_memory(dtype, [K_STAGES, BLOCK_N, D_MAIN], kv_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_MAIN], kv_layout)
        if D_TAIL > 0:  # the head dim's tail columns, in buffers of their own width
            qt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_HALF_M, D_TAIL], dtype)
            kvt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_TAIL], dtype)
            qt_smem = gl.allocate_shared_memory(dtype, [NUM_CONS * Q_BUFS, _HALF_M, D_TAIL], qt_layout)
            kt_smem = gl.allocate_shared_memory(dtype, [K_STAGES, BLOCK_N, D_TAIL], kvt_layout)
            vt_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_TAIL], kvt_layout)
        else:  # never read
            qt_smem = q_smem
            kt_smem = k_smem
            vt_smem = v_smem
        if O_OWN:  # an O buffer per consumer (`_o_own`), else O goes out through the tile's Q buffer
            o_smem = gl.allocate_shared_memory(dtype, [NUM_CONS, _HALF_M, D_MAIN], q_layout)
            if D_TAIL > 0:
                ot_smem = gl.allocate_shared_memory(dtype, [NUM_CONS, _HALF_M, D_TAIL], qt_layout)
            else:
                ot_smem = o_smem
        else:  # never read
            o_smem = q_smem
            ot_smem = qt_smem
        q_ready = gl.allocate_shared_memory(gl.int64, [NUM_CONS * Q_BUFS, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [NUM_CONS * Q_BUFS, 1], mbarrier.MBarrierLayout())
        # the K and V rings: K_STAGES and STAGES slots (a slot's K is read by S = Q K^T, a step before its V by the
        # PV matmul, so it is free sooner)
        k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # a Q block's tile coordinates, from the producer to its consumer (`_post_tile`)
        info = gl.allocate_shared_memory(gl.int32, [NUM_CONS * Q_BUFS, 4], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        for i in gl.static_range(NUM_CONS * Q_BUFS):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=1)
        for i in gl.static_range(K_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=NUM_CONS)  # released by every consumer
        for i in gl.static_range(STAGES):
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=NUM_CONS)
        if PINGPONG:  # turn[c]: consumer c's to issue its next matmuls, handed over by the other (`_hand_over`)
            turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            mbarrier.init(turn.index(0), count=1)
            mbarrier.init(turn.index(1), count=1)
        else:  # never read
            turn = v_empty
        fence_async_shared()
        if PINGPONG:
            mbarrier.arrive(turn.index(0), count=1)  # consumer 0 issues first
        # (the argument tuples are spelled out, once per consumer count: a tuple or list built in Gluon code drops
        # its constexprs, so the partitions cannot be assembled in a loop)
        if NUM_CONS == 3:
            gl.warp_specialize([
                (_consumer, (0, O, O_T, LSE, q_smem, k_smem, v_smem, qt_smem, kt_smem, vt_smem, o_smem, ot_smem,
                             q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, info, n_q, n_k,
                             causal_off, qk_scale, IS_CAUSAL, D_MAIN, D_TAIL, BLOCK_N, K_STAGES, STAGES, Q_BUFS, O_OWN,
                             NUM_CONS, PINGPONG, PEEL, SWAP, EXP_POLY)),
                (_consumer, (1, O, O_T, LSE, q_smem, k_smem, v_smem, qt_smem, kt_smem, vt_smem, o_smem, ot_smem,
                             q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, info, n_q, n_k,
                             causal_off, qk_scale, IS_CAUSAL, D_MAIN, D_TAIL, BLOCK_N, K_STAGES, STAGES, Q_BUFS, O_OWN,
                             NUM_CONS, PINGPONG, PEEL, SWAP, EXP_POLY)),
                (_consumer, (2, O, O_T, LSE, q_smem, k_smem, v_smem, qt_smem, kt_smem, vt_smem, o_smem, ot_smem,
                             q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, info, n_q, n_k,
                             causal_off, qk_scale, IS_CAUSAL, D_MAIN, D_TAIL, BLOCK_N, K_STAGES, STAGES, Q_BUFS, O_OWN,
                             NUM_CONS, PINGPONG, PEEL, SWAP, EXP_POLY)),
                (_producer, (Q, K, V, Q_T, K_T, V_T, q_smem, k_smem, v_smem, qt_smem, kt_smem, vt_smem, q_ready,
                             q_empty, k_ready, v_ready, k_empty, v_empty, info, n_units, n_pairs, n_tiles, n_zh,
                             n_tail, n_heads, kv_group, n_k, causal_off, IS_CAUSAL, D_MAIN, D_TAIL, BLOCK_N, K_STAGES,
                             STAGES, Q_BUFS, NUM_CONS, SWAP)),
            ], [4, 4, PRODUCER_WARPS], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (0, O, O_T, LSE, q_smem, k_smem, v_smem, qt_smem, kt_smem, vt_smem, o_smem, ot_smem,
                             q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, info, n_q, n_k,
                             causal_off, qk_scale, IS_CAUSAL, D_MAIN, D_TAIL, BLOCK_N, K_STAGES, STAGES, Q_BUFS, O_OWN,
                             NUM_CONS, PINGPONG, PEEL, SWAP, EXP_POLY)),
                (_consumer, (1, O, O_T, LSE, q_smem, k_smem, v_smem, qt_smem, kt_smem, vt_smem, o_smem, ot_smem,
                             q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, info, n_q, n_k,
                             causal_off, qk_scale, IS_CAUSAL, D_MAIN, D_TAIL, BLOCK_N, K_STAGES, STAGES, Q_BUFS, O_OWN,
                             NUM_CONS, PINGPONG, PEEL, SWAP, EXP_POLY)),
                (_producer, (Q, K, V, Q_T, K_T, V_T, q_smem, k_smem, v_smem, qt_smem, kt_smem, vt_smem, q_ready,
                             q_empty, k_ready, v_ready, k_empty, v_empty, info, n_units, n_pairs, n_tiles, n_zh,
                             n_tail, n_heads, kv_group, n_k, causal_off, IS_CAUSAL, D_MAIN, D_TAIL, BLOCK_N, K_STAGES,
                             STAGES, Q_BUFS, NUM_CONS, SWAP)),
            ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


# ---------------------------------------------------------------------- host side
def _o_own(d: int, block_n: int, stages: int, q_bufs: int, consumers: int, k_stages: int) -> bool:
    """Whether a tile set leaves room for an O buffer per consumer: then a tile's Q buffer goes back to the producer
    after the last S = Q K^T, not after the O store (with one Q buffer that delays the next tile's Q load: 1.08-1.11x
    the time at d = 64 from 8192 rows), and a store's wait moves to the next tile's epilogue."""
    q_o_kv = consumers * (q_bufs + 1) * HALF_M * d + (k_stages + stages) * block_n * d  # elements (2 bytes)
    return 2 * q_o_kv <= SMEM_LIMIT - 1024  # less the mbarriers' kilobyte at most


def tail_heads(n_zh: int, n_tiles: int, grid: int, kv_bytes: int, l2_bytes: int) -> int:
    """How many heads, the last ones, `_tile` deals as a tail of single query tiles, heaviest first, rather than as
    units of two (0: none). The fewest such that the units of the heads before fill whole rounds of `grid` programs
    (heads x n_tiles / 2 a multiple of grid; with an odd tile count that takes an even number of heads, as two
    heads' middle tiles make a unit), the tail's tiles make two rounds or more (so the deal evens out), and the tail
    heads' K and V (kv_bytes a query head) fit in half the L2 (every tail head is at work at once)."""
    step = 2 * grid // math.gcd(n_tiles, 2 * grid)  # head counts whose units fill whole rounds: multiples of step
    fewest = max(1, _cdiv(2 * grid, n_tiles))
    if n_zh < fewest:
        return 0
    tail = n_zh - (n_zh - fewest) // step * step
    return tail if 2 * tail * kv_bytes <= l2_bytes else 0


def fwd_applies(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether `_fwd_ws_kernel` can run this forward: compiled CUDA on sm_90 (wgmma is sm_90 only), fp16 / bf16,
    head dim in HEAD_DIMS, and for the TMA unit last strides, 16-byte aligned bases and (batch, head, row)
    strides that are positive multiples of 16 bytes."""
    if common.INTERPRET or not HAVE_GLUON or q.device.type != "cuda" or q.dim() != 4:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    d = q.shape[3]
    if d not in HEAD_DIMS or k.shape[3] != d or v.shape[3] != d or launch._capability(q.device) != (9, 0):
        return False
    # (expanded operands, stride 0, take the Triton forward: a TMA descriptor's strides are positive)
    return all(common._tma_aligned(t) and t.stride(3) == 1
               and all(s > 0 and s % 8 == 0 for s in t.stride()[:3]) for t in (q, k, v))


def fwd_tiles(d: int, n_q: int, is_causal: bool, short_rows: int, long_rows: int) -> tuple[int, ...]:
    """(BLOCK_N, STAGES, Q_BUFS, consumers) for a forward of n_q query rows: `SHORT_TILES` under a causal mask below
    short_rows rows, `FWD_TILES` below long_rows rows, from there on `WIDE_TILES` where the head dim has them, else
    `FWD_TILES` (the rows: `FlashConfig.hopper_fwd_rows`)."""
    if is_causal and n_q < short_rows:
        return SHORT_TILES[d]
    if n_q < long_rows:
        return FWD_TILES[d]
    return WIDE_TILES.get(d, FWD_TILES[d])


def pingpong(d: int, block_n: int, consumers: int) -> bool:
    """Whether the two consumers issue their matmuls in turns (`PINGPONG_HEAD_DIMS`)."""
    return consumers == 2 and block_n == 128 and d in PINGPONG_HEAD_DIMS


def swap_halves(is_causal: bool, block_n: int, consumers: int, turns: bool) -> bool:
    """Whether two consumers take alternate halves of their query tiles (`_half`) and skip the key tiles wholly
    masked for their rows: under a causal mask, with 64-key tiles (with 128-key tiles both halves see the
    diagonal tile) and no ping-pong turns (which count equal matmul groups a consumer)."""
    return is_causal and consumers == 2 and block_n == 64 and not turns


def producer_warps(block_n: int) -> int:
    """Warps of the producer partition: with 64-key tiles one, which leaves three of the SM's four schedulers wholly
    to the consumers (0.97-0.98x the time of a warpgroup at d = 64-96, S = 512-2048, level at d = 128); with 128-key
    tiles a warpgroup (one warp took 1.00-1.03x its time). Triton pads a one-warp partition to a warpgroup for
    setmaxnreg; the padding warps idle."""
    return 1 if block_n == 64 else 4


def exp2_poly(d: int, block_n: int, consumers: int) -> bool:
    """Whether the consumers compute one exponential of each 8 by a polynomial on the FMA units (`_exp2`): at d = 64
    with two consumers over 128-key tiles, whose exponentials take the special-function units as long as their
    matmuls take the tensor cores (0.95-0.98x the time at (32, 16, 2048) causal, 0.99x at (8, 16, 2048) causal and
    (128, 16, 512) without the mask, level at (64, 16, 1024) causal). Not over the 64-key short-row tiles
    (1.01-1.03x at 512 rows causal), with three consumers, whose instruction issue, not the special-function units,
    bounds them (1.06-1.15x), nor at d = 128 (level) or with d = 80's three consumers (1.02x); two or four of each 8
    took longer everywhere (1.0-1.3x)."""
    return d == 64 and block_n == 128 and consumers == 2


def peel(d: int, block_n: int, consumers: int, is_causal: bool) -> int:
    """How the consumers run a query tile's first key tile (`_attend`'s PEEL):
    - IN_LOOP: in the loop with the others, its PV P = 0 times its own V tile (a no-op matmul), the mask behind the
      loop's branch: one copy of a step's code;
    - PEEL_ONE_LOOP: peeled off the loop (S_0 and its softmax alone), the other key tiles in one loop, the mask
      behind its branch: two copies;
    - PEEL_TWO_LOOPS: peeled off, then a loop over the full key tiles and one over the masked ones: three copies.
    Fewer copies are fewer instructions for the instruction cache (with three, ncu counted 12-19% of the warps'
    stall samples waiting for instructions at (128, 16, 512, 128)); the peel saves the no-op matmul, one of a tile's
    n + 1 PV matmuls. Measured (H100, one process, the kernel alone), PEEL_ONE_LOOP's time over IN_LOOP's: two
    consumers over 64-key tiles (short rows under a causal mask) 0.93-0.99x at 512-1024 rows, d = 64 to 128;
    128-key tiles without the mask at d = 80-128, 0.96-0.99x at 512-4096 rows (d = 128), 0.95-0.99x (d = 96),
    0.97-1.01x (d = 80), level at 8192; but under the mask at d = 128 1.00-1.06x, and at d = 64 (two or three
    consumers, bound by the exponentials) 1.03-1.08x, so those keep IN_LOOP. Three consumers over 64-key tiles
    (d = 80 and 96 from `hopper_fwd_long_rows` rows) keep PEEL_TWO_LOOPS: IN_LOOP took 1.05-1.07x its time,
    PEEL_ONE_LOOP 1.01-1.06x."""
    if consumers == 3 and block_n == 64:
        return PEEL_TWO_LOOPS
    if block_n == 64 or (d > 64 and not is_causal):
        return PEEL_ONE_LOOP
    return IN_LOOP


def fwd_constexprs(d: int, is_causal: bool, tiles: tuple[int, ...], turns: bool | None = None,
                   first: int | None = None, swap: bool | None = None, warps: int | None = None,
                   exp_poly: bool | None = None) -> dict:
    """`_fwd_ws_kernel`'s compile-time parameters for head dim d and tiles (BLOCK_N, STAGES, Q_BUFS, consumers[,
    K_STAGES]; the K ring as deep as the V ring's STAGES unless named):
    the policies' choices (`pingpong`, `peel`, `swap_halves`, `producer_warps`, `exp2_poly`) where an argument
    does not override them (`launch_fwd`)."""
    d_main, d_tail = common._TILE_D[d]
    block_n, stages, q_bufs, consumers = tiles[:4]
    k_stages = tiles[4] if len(tiles) > 4 else stages
    turns_on = pingpong(d, block_n, consumers) if turns is None else turns
    return dict(
        IS_CAUSAL=is_causal, D_MAIN=d_main, D_TAIL=d_tail, BLOCK_N=block_n, K_STAGES=k_stages, STAGES=stages,
        Q_BUFS=q_bufs, O_OWN=_o_own(d, block_n, stages, q_bufs, consumers, k_stages), NUM_CONS=consumers,
        PINGPONG=turns_on,
        PEEL=peel(d, block_n, consumers, is_causal) if first is None else first,
        SWAP=swap_halves(is_causal, block_n, consumers, turns_on) if swap is None else swap,
        CONSUMER_REGS=CONSUMER_REGS[consumers], PRODUCER_REGS=PRODUCER_REGS,
        PRODUCER_WARPS=producer_warps(block_n) if warps is None else warps,
        EXP_POLY=exp2_poly(d, block_n, consumers) if exp_poly is None else exp_poly)


class FwdReplay:
    """`launch_fwd` again, for inputs of the geometry (shapes, strides, dtype) and the mask it was made for: its
    descriptors' fields and its launch (`launch.Replay`) are kept, so a call makes 4 descriptors (8 with a tail)
    and launches (`dispatch.flash_fwd_impl` keeps these per geometry)."""

    __slots__ = ("fields", "tail_fields", "d_main", "replay")

    def __init__(self, descs: tuple, tails: tuple | None, d_main: int, replay: "launch.Replay") -> None:
        self.fields = [desc_fields(x) for x in descs]
        self.tail_fields = None if tails is None else [desc_fields(x) for x in tails]
        self.d_main, self.replay = d_main, replay

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor) -> None:
        """The forward into o and lse (as `launch_fwd`'s); q, k, v 16-byte aligned (the caller checks)."""
        ts = (q, k, v, o)
        # a main part's descriptor reads from its tensor's base: the fields hold its narrower shape
        descs = [desc_over(f, t) for f, t in zip(self.fields, ts)]
        if self.tail_fields is None:
            self.replay(*descs, None, None, None, None, lse)
        else:
            m = self.d_main
            self.replay(*descs, *[desc_over(f, t[..., m:]) for f, t in zip(self.tail_fields, ts)], lse)


def launch_fwd(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, is_causal: bool, sm_scale: float,
               tiles: tuple[int, ...] | None = None, turns: bool | None = None,
               first: int | None = None, swap: bool | None = None, warps: int | None = None,
               exp_poly: bool | None = None, tail: int | None = None, replay: bool = False) -> FwdReplay | None:
    """O (preallocated like q, or at any strides a TMA descriptor takes: unit last, 16-byte aligned base and
    others) and lse ((Z, H, N_q) fp32, contiguous) of attention on 4-D (Z, H, N, d) q, k, v (k, v: H / kv_group
    heads), where `fwd_applies`; tiles: (BLOCK_N, STAGES, Q_BUFS, consumers), `FWD_TILES`' by default; turns:
    ping-pong between two consumers, by default where `pingpong`; first: how a query tile's first key tile runs
    (IN_LOOP, PEEL_ONE_LOOP or PEEL_TWO_LOOPS), by default `peel`'s; swap: two consumers on alternate halves, by
    default where `swap_halves`; warps: the producer's, by default `producer_warps`; exp_poly: an eighth of the
    exponentials by polynomial, by default where `exp2_poly`; tail: the heads dealt as single tiles at the end of the
    schedule, by default `tail_heads`' (none without the causal mask). With `replay`, the launch as a `FwdReplay`
    where it was a direct one (`launch.Replay`), else None."""
    z, h, n_q, d = q.shape
    n_k = k.shape[2]
    d_main, d_tail = common._TILE_D[d]
    tiles = tiles or FWD_TILES[d]
    block_n, consumers = tiles[0], tiles[3]
    causal_off = n_k - n_q if is_causal else 0
    boxes = ((q, HALF_M), (k, block_n), (v, block_n), (o, HALF_M))  # (tensor, rows a load or store takes)
    # descriptors of the head dim's main part and tail, made on the host (in every program they cost 20-25% at
    # S = 512)
    descs, tails = zip(*(part_descs(t, rows, d_main, d_tail) for t, rows in boxes))
    if not d_tail:  # None, a constexpr, rather than descriptors the launcher would encode and the kernel never read
        tails = (None,) * 4
    # persistent: a program an SM (their shared memory allows no second); on a grid of fewer than half as many
    # pairs of query tiles, a tile a program (`_tile`)
    n_tiles = _cdiv(n_q, consumers * HALF_M)
    grid = min(2 * _cdiv(z * h * n_tiles, 2), launch._sm_count(q.device))  # 2 x the units (`_tile`)
    if tail is None:
        tail = tail_heads(z * h, n_tiles, grid, 4 * n_k * d // (h // k.shape[1]), launch._l2_bytes(q.device)) \
            if is_causal else 0
    direct = launch._run(_fwd_ws_kernel, (grid,),
                         (*descs, *tails, lse, h, h // k.shape[1], n_q, n_k, causal_off, sm_scale * LOG2E, z * h,
                          tail), 9,
                         replay, **fwd_constexprs(d, is_causal, tiles, turns, first, swap, warps, exp_poly),
                         num_warps=4)
    return None if direct is None else FwdReplay(descs, tails if d_tail else None, d_main, direct)
