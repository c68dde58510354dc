"""`FlashConfig`: every choice flash_triton makes besides what the inputs fix (tiles, backward variant, split-KV).

Built from `conf/attention_impl/flash_triton.yaml` (its `config:` block) and handed to the kernels through the
attention plugin (`KernelAttention`): ``FlashAttentionTriton.apply(q, k, v, is_causal, config)``. No module-level
switch or environment variable changes what the kernels compute or how fast: a benchmark variant is a config
override (`FlashConfig.with_overrides("backward=fused,fwd=64x64x4x3")`).

The defaults are the measured policy of docs/attention.md; `FlashConfig()` equals the yaml's block
(tests/test_flash_attention.py checks it).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from functools import lru_cache
from typing import Any, Mapping

from core.errors import ConfigError

TILE_KERNELS = ("fwd", "dq", "dkdv", "fused")
# "auto"'s Gluon backward from these query rows on, by head dim (docs/attention.md)
WS_MIN_ROWS = {64: 2048, 80: 2048, 96: 1024, 128: 512}
_WS_DEFAULT = tuple(sorted(WS_MIN_ROWS.items()))
BACKWARDS = ("auto", "two_pass", "atomic_dq", "fused")
SPLIT_MERGES = ("in_kernel", "separate")
_KEY = "attention_impl.config"


def causal_rows(n_q: int, is_causal: bool) -> int:
    """n_q query rows counted as rows under a causal mask, the unit of the backward's row thresholds: without the
    mask a row sees every key, twice a causal row's on average, so a kernel's fixed costs weigh as on causal rows
    twice as long."""
    return n_q if is_causal else 2 * n_q


@dataclass(frozen=True)
class FlashConfig:
    """What flash_triton chooses, besides the inputs (see docs/attention.md, "Configuration").

    tiles: per kernel (fwd, dq, dkdv, fused) a fixed (BLOCK_M, BLOCK_N, num_warps, num_stages[, maxnreg]); kernels
        not named are autotuned (the CPU interpreter always uses its own small tiles). `dkdv` pins the two-pass and
        the atomic-dQ dK/dV kernel.
    backward: "auto" (fused on small grids, the Hopper warp-specialised kernel for long rows, else two passes),
        or one variant for every call: "two_pass", "atomic_dq", "fused".
    fused_max_tiles / fused_max_tiles_wide: "auto" takes the fused backward up to this many batch x heads x 64-row
        tiles, for head dims <= 64 / above 64.
    hopper_ws: the warp-specialised Gluon backward on sm_90 (the atomic-dQ variant's kernel there).
    ws_min_rows: "auto" takes that kernel from this many causal rows on (`causal_rows`: query rows under a causal
        mask, a row without it counting twice), by head dim ({64: 2048, ...}; a head dim not named: never), or one
        number for every head dim.
    ws_gqa_max_rows: with grouped-query attention the Gluon backward runs a program per KV head (walking its
        query heads, dK and dV summed in the kernel) below this many causal rows; from there on, and with 0 always,
        a program per query head (dK, dV summed afterwards).
    hopper_fwd: the warp-specialised Gluon forward on sm_90 where it applies (`hopper_forward.fwd_applies`), on
        grids the split-KV forward would not split; hopper_fwd_long_rows: from this many query rows on, its
        long-row tiles (three consumers at d = 64, 80, 96; 128-key tiles at 128), below under a causal mask 64-key
        tiles (a short causal row's few key tiles, the last one half masked, pipeline better in more, smaller
        steps), without the mask the 128-key tiles;
        hopper_fwd_d64_min_rows: at head dim 64 under a causal mask only from this many query rows on (shorter rows
        keep the Triton forward; without the mask the Gluon kernel wins at every length); there its 64-key tiles
        below hopper_fwd_d64_short_rows rows, its long-row tiles from hopper_fwd_d64_long_rows rows on, and two
        consumers with 128-key tiles between; without the mask at d = 64 its long-row tiles from
        hopper_fwd_d64_unmasked_long_rows rows on.
    split_kv: the split-KV forward on grids that leave SMs idle; split_keys forces a split length in keys on every
        call (tests); max_splits caps the splits per query tile.
    split_merge: "in_kernel" (the split that arrives last merges: one launch) or "separate" (a merge kernel: two).
    short_row_tiles: rows of fewer key tiles than this use the split forward's 32-row tiles and one loop per split.
    poison_outputs: fill outputs with NaN before the kernels run, so an unwritten element shows (debugging, tests).
    """

    # given as a mapping (the yaml's dict); kept as sorted (kernel, tiles) pairs, so the config stays hashable
    tiles: Mapping[str, tuple[int, ...]] | tuple[tuple[str, tuple[int, ...]], ...] = field(default_factory=dict)
    backward: str = "auto"
    fused_max_tiles: int = 256
    fused_max_tiles_wide: int = 128
    hopper_ws: bool = True
    # a mapping is kept as sorted (head dim, rows) pairs, like tiles
    ws_min_rows: Mapping[int, int] | tuple[tuple[int, int], ...] | int = field(
        default_factory=lambda: dict(WS_MIN_ROWS))
    ws_gqa_max_rows: int = 32768
    hopper_fwd: bool = True
    hopper_fwd_long_rows: int = 2048
    hopper_fwd_d64_min_rows: int = 512
    hopper_fwd_d64_short_rows: int = 1024
    hopper_fwd_d64_long_rows: int = 4096
    hopper_fwd_d64_unmasked_long_rows: int = 1024
    split_kv: bool = True
    split_keys: int | None = None
    max_splits: int = 4
    split_merge: str = "in_kernel"
    short_row_tiles: int = 32
    poison_outputs: bool = False

    def __post_init__(self) -> None:
        tiles = {}
        for kind, cfg in dict(self.tiles or {}).items():
            if kind not in TILE_KERNELS:
                raise ConfigError(f"{_KEY}.tiles", f"unknown kernel {kind!r}", f"name one of {', '.join(TILE_KERNELS)}")
            try:
                cfg = tuple(int(x) for x in cfg)
            except (TypeError, ValueError):
                cfg = ()
            if len(cfg) not in (4, 5) or min(cfg) < 1 or any(b < 16 or b & (b - 1) for b in cfg[:2]):
                raise ConfigError(f"{_KEY}.tiles.{kind}", f"bad tile config {self.tiles[kind]!r}",
                                  "give [BLOCK_M, BLOCK_N, num_warps, num_stages] (optionally maxnreg), "
                                  "block sizes powers of two from 16")
            tiles[kind] = cfg
        # equal whatever order the yaml lists the kernels in
        object.__setattr__(self, "tiles", tuple(sorted(tiles.items())))
        for name, allowed in (("backward", BACKWARDS), ("split_merge", SPLIT_MERGES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{_KEY}.{name}", f"unknown value {getattr(self, name)!r}",
                                  f"use one of {', '.join(allowed)}")
        object.__setattr__(self, "ws_min_rows", _rows_by_head_dim(self.ws_min_rows, f"{_KEY}.ws_min_rows"))
        for name in ("fused_max_tiles", "fused_max_tiles_wide", "ws_gqa_max_rows", "hopper_fwd_long_rows",
                     "hopper_fwd_d64_min_rows", "hopper_fwd_d64_short_rows", "hopper_fwd_d64_long_rows", "hopper_fwd_d64_unmasked_long_rows",
                     "max_splits", "short_row_tiles"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ConfigError(f"{_KEY}.{name}", f"{getattr(self, name)!r} is not a non-negative integer",
                                  "give a whole number >= 0")
        if self.max_splits < 2:
            raise ConfigError(f"{_KEY}.max_splits", f"{self.max_splits} splits cannot split",
                              "use 2 or more (split_kv: false turns splitting off)")
        if self.split_keys is not None and (not isinstance(self.split_keys, int) or self.split_keys < 1):
            raise ConfigError(f"{_KEY}.split_keys", f"{self.split_keys!r} is not a positive key count",
                              "give null (the policy decides) or a number of keys >= 1")
        # the config as a string: what the custom ops take (they accept no Python objects); read, not computed,
        # while torch.compile traces
        object.__setattr__(self, "key", _to_key(self))

    def tile(self, kind: str) -> tuple[int, ...] | None:
        """The pinned (BLOCK_M, BLOCK_N, warps, stages[, maxnreg]) of a kernel, or None (autotuned)."""
        for name, cfg in self.tiles:
            if name == kind:
                return cfg
        return None

    def ws_rows(self, d: int) -> int | None:
        """`ws_min_rows` at head dim d, in causal rows (`causal_rows`); None: "auto" never takes the Gluon backward
        there."""
        if isinstance(self.ws_min_rows, int):
            return self.ws_min_rows
        return next((r for dim, r in self.ws_min_rows if dim == d), None)

    def takes_ws(self, d: int, n_q: int, is_causal: bool) -> bool:
        """Whether "auto" takes the Gluon backward for n_q query rows at head dim d (where it applies):
        from `ws_rows(d)` causal rows on."""
        rows = self.ws_rows(d)
        return rows is not None and causal_rows(n_q, is_causal) >= rows

    def ws_gqa_heads(self, group: int, n_q: int, is_causal: bool) -> int:
        """Query heads a program of the Gluon backward walks: the GQA group below `ws_gqa_max_rows` causal rows
        (`causal_rows`), else 1."""
        return group if causal_rows(n_q, is_causal) < self.ws_gqa_max_rows else 1

    def hopper_fwd_rows(self, d: int, is_causal: bool) -> tuple[int, int, int]:
        """The Gluon forward's row thresholds at head dim d: (from how many query rows it runs, below how many its
        short-row tiles serve a causal mask, from how many its long-row tiles serve)."""
        if d != 64:
            return 0, self.hopper_fwd_long_rows, self.hopper_fwd_long_rows
        if is_causal:
            return self.hopper_fwd_d64_min_rows, self.hopper_fwd_d64_short_rows, self.hopper_fwd_d64_long_rows
        return 0, 0, self.hopper_fwd_d64_unmasked_long_rows

    def replace(self, **changes: Any) -> "FlashConfig":
        return dataclasses.replace(self, **changes)

    def with_overrides(self, spec: str) -> "FlashConfig":
        """This config with `key=value` pairs applied, comma-separated: field names (`backward=fused`,
        `hopper_ws=0`, `split_merge=separate`, `ws_min_rows=64:2048/128:1024`) or a kernel's tiles
        (`fwd=128x64x8x3`, `dkdv=64x64x4x3x168`)."""
        changes: dict[str, Any] = {}
        tiles = dict(self.tiles)
        names = {f.name: f for f in fields(self)}
        for part in filter(None, spec.split(",")):
            name, _, value = part.partition("=")
            if name not in TILE_KERNELS and (name not in names or name == "tiles"):
                raise ConfigError(f"{_KEY}.{name}", f"unknown override {part!r}",
                                  f"use a field ({', '.join(n for n in names if n != 'tiles')}) or a kernel's tiles "
                                  f"({'/'.join(TILE_KERNELS)}=BMxBNxWARPSxSTAGES)")
            try:
                if name in TILE_KERNELS:
                    tiles[name] = tuple(int(x) for x in value.split("x"))
                else:
                    changes[name] = _parse(value, getattr(self, name), name)
            except ConfigError:
                raise
            except ValueError:  # a number that does not parse: one line naming the key, no traceback
                example = {"ws_min_rows": "2048 or 64:2048/128:1024", "split_keys": "256 or none"}.get(
                    name, "64x64x4x3" if name in TILE_KERNELS else str(getattr(self, name)))
                key = f"{_KEY}.tiles.{name}" if name in TILE_KERNELS else f"{_KEY}.{name}"
                raise ConfigError(key, f"{value!r} does not parse", f"write e.g. {name}={example}") from None
        return self.replace(tiles=tiles, **changes)

    @staticmethod
    def from_key(key: str) -> "FlashConfig":
        """The config whose `key` this is ("" is the default config)."""
        return _from_key(key)


def _rows_by_head_dim(value: Any, key: str) -> tuple[tuple[int, int], ...] | int:
    """A row threshold: one non-negative number, or a mapping head dim -> number (as sorted pairs)."""
    fix = "give a number of rows >= 0, or a mapping head dim -> rows, e.g. {64: 2048, 128: 1024}"
    if isinstance(value, Mapping) or isinstance(value, tuple):
        try:
            pairs = tuple(sorted((int(d), rows) for d, rows in dict(value).items()))
        except (TypeError, ValueError):
            raise ConfigError(key, f"{value!r} is not a mapping of head dims to rows", fix) from None
        if all(isinstance(rows, int) and not isinstance(rows, bool) and rows >= 0 and d > 0 for d, rows in pairs):
            return pairs
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ConfigError(key, f"{value!r} is not a row count or a mapping of head dims to row counts", fix)


def _to_key(cfg: FlashConfig) -> str:
    """The fields that differ from their defaults, as compact JSON ("" for the default config)."""
    changed = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.name == "tiles":
            if value:
                changed["tiles"] = {k: list(v) for k, v in value}
        elif f.name == "ws_min_rows":
            if value != _WS_DEFAULT:
                changed[f.name] = dict(value) if isinstance(value, tuple) else value
        elif value != f.default:
            changed[f.name] = value
    return json.dumps(changed, sort_keys=True, separators=(",", ":")) if changed else ""


def _parse(value: str, current: Any, name: str) -> Any:
    if isinstance(current, bool):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{_KEY}.{name}", f"{value!r} is not a boolean", "use 0/1 or true/false")
    if name == "ws_min_rows":  # 2048, or 64:2048/128:1024 (braces, as Hydra spells a mapping, allowed)
        text = value.strip().strip("{}")
        if ":" not in text:
            return int(text)
        return {int(d): int(rows) for d, rows in (pair.split(":") for pair in text.split("/"))}
    if isinstance(current, int) or name == "split_keys":
        if value.lower() in ("none", "null", ""):
            return None
        return int(value)
    return value


@lru_cache(maxsize=64)
def _from_key(key: str) -> FlashConfig:
    return FlashConfig(**json.loads(key)) if key else DEFAULT_CONFIG


DEFAULT_CONFIG = FlashConfig()
