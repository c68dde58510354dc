"""Training data: the `data` plugins.

Each source yields batches of (inputs, targets) token windows, (B, T) int64, sampled
by a generator seeded from (seed, step): batch k is the same whatever happened before,
so the data position in a checkpoint is just the step, and every data-parallel rank
draws the same global batch and keeps its own rows (identical to single-process
training on the whole batch).
"""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from core.errors import ConfigError, require


class TokenSource:
    """A train and a validation array of token ids, sampled as random windows."""

    def __init__(self, seq_len: int, overfit_batches: int = 0) -> None:
        require(isinstance(seq_len, int) and seq_len > 0, "data.seq_len", f"must be a positive integer, got {seq_len!r}",
                "set data.seq_len")
        require(isinstance(overfit_batches, int) and overfit_batches >= 0, "data.overfit_batches",
                f"must be 0 (off) or a number of batches, got {overfit_batches!r}", "set data.overfit_batches=0 or 1")
        self.seq_len = seq_len
        self.overfit_batches = overfit_batches  # k > 0: training cycles through the same k batches
        self.train: np.ndarray | None = None
        self.val: np.ndarray | None = None

    # ---- subclasses fill train/val in load() -------------------------------------------
    def load(self) -> "TokenSource":
        return self

    @property
    def max_token_id(self) -> int:
        return max(int(self.train.max()), int(self.val.max()))

    def describe(self) -> str:
        return f"{type(self).__name__}: {len(self.train):,} train / {len(self.val):,} val tokens"

    def check_vocab(self, vocab_size: int) -> None:
        top = self.max_token_id
        require(top < vocab_size, "model.vocab_size",
                f"the data holds token id {top} but the vocabulary has only {vocab_size} entries",
                f"set model.vocab_size >= {top + 1} or use data that matches the model")

    def batch(self, split: str, step: int, batch_size: int, seed: int, device: torch.device,
              rows: slice | None = None) -> tuple[Tensor, Tensor]:
        """The global batch number `step` of `split`, optionally only `rows` of it, on `device`."""
        data = self.train if split == "train" else self.val
        if split == "train" and self.overfit_batches:
            step %= self.overfit_batches
        n = len(data) - self.seq_len - 1
        require(n > 0, "data.seq_len", f"the {split} split ({len(data)} tokens) is shorter than one window",
                "use a shorter data.seq_len or more data")
        gen = torch.Generator().manual_seed((seed * 1_000_003 + step * 2 + (split != "train")) % (2**63))
        starts = torch.randint(0, n, (batch_size,), generator=gen)
        if rows is not None:
            starts = starts[rows]
        idx = starts.numpy()[:, None] + np.arange(self.seq_len + 1)[None, :]
        window = torch.from_numpy(np.asarray(data[idx], dtype=np.int64))
        if device.type == "cuda":
            window = window.pin_memory().to(device, non_blocking=True)
        else:
            window = window.to(device)
        return window[:, :-1], window[:, 1:]


def _split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    require(0.0 < val_fraction < 0.5, "data.val_fraction", f"{val_fraction} is outside (0, 0.5)", "use e.g. 0.05")
    cut = int(len(tokens) * (1.0 - val_fraction))
    return tokens[:cut], tokens[cut:]


class CorpusData(TokenSource):
    """Bytes of the Python standard library's own sources: text every machine has.

    Files are read in sorted order up to `max_bytes`, so the corpus is the same on
    every run of one Python version; the last `val_fraction` is held out.
    """

    def __init__(self, seq_len: int, max_bytes: int = 4_000_000, val_fraction: float = 0.05,
                 root: str | None = None, overfit_batches: int = 0) -> None:
        super().__init__(seq_len, overfit_batches)
        self.max_bytes, self.val_fraction = max_bytes, val_fraction
        self.root = Path(root or sysconfig.get_paths()["stdlib"])

    def load(self) -> "CorpusData":
        require(self.root.is_dir(), "data.root", f"{self.root} is not a directory", "point data.root at a source tree")
        chunks, total = [], 0
        for path in sorted(self.root.rglob("*.py")):
            if "site-packages" in path.parts or "test" in path.parts:
                continue
            try:
                text = path.read_bytes()
            except OSError:
                continue
            chunks.append(text)
            total += len(text)
            if total >= self.max_bytes:
                break
        tokens = np.frombuffer(b"".join(chunks)[: self.max_bytes], dtype=np.uint8)
        require(len(tokens) > 10 * self.seq_len, "data", f"only {len(tokens)} bytes of Python sources found under {self.root}",
                "use data=synthetic or data=tokens")
        self.train, self.val = _split(tokens, self.val_fraction)
        return self

    @property
    def max_token_id(self) -> int:
        return 255


class SyntheticData(TokenSource):
    """Uniform random tokens in [0, vocab_size) (shapes for benchmarks; nothing to learn)."""

    def __init__(self, seq_len: int, vocab_size: int, num_tokens: int = 1 << 20, seed: int = 1234,
                 overfit_batches: int = 0) -> None:
        super().__init__(seq_len, overfit_batches)
        self.vocab_size, self.num_tokens, self.seed = vocab_size, num_tokens, seed

    def load(self) -> "SyntheticData":
        rng = np.random.default_rng(self.seed)
        dtype = np.uint16 if self.vocab_size <= 65536 else np.uint32
        tokens = rng.integers(0, self.vocab_size, size=max(self.num_tokens, 4 * (self.seq_len + 1)), dtype=dtype)
        self.train, self.val = tokens, tokens[-max(len(tokens) // 20, 2 * (self.seq_len + 1)):]
        return self

    @property
    def max_token_id(self) -> int:
        return self.vocab_size - 1


class TokenFileData(TokenSource):
    """A memory-mapped flat array of uint16/uint32 token ids (nanoGPT / CS336 `.bin` / `.npy`)."""

    def __init__(self, seq_len: int, path: str, val_path: str | None = None, val_fraction: float = 0.05,
                 dtype: str = "uint16", overfit_batches: int = 0) -> None:
        super().__init__(seq_len, overfit_batches)
        require(dtype in ("uint16", "uint32"), "data.dtype", f"unsupported token dtype {dtype!r}",
                "use data.dtype=uint16 or uint32")
        self.path, self.val_path, self.val_fraction, self.dtype = path, val_path, val_fraction, np.dtype(dtype)

    def _open(self, key: str, path: str) -> np.ndarray:
        p = Path(os.path.expanduser(str(path)))
        require(p.is_file(), key, f"token file {p} does not exist", f"set {key} to an existing .bin or .npy file")
        if p.suffix == ".npy":
            try:
                arr = np.load(p, mmap_mode="r")
            except Exception as e:
                raise ConfigError(key, f"{p} is not a readable .npy array ({e})", "write it with np.save") from None
            require(arr.ndim == 1 and arr.dtype in (np.uint16, np.uint32, np.int32, np.int64), key,
                    f"{p} holds a {arr.ndim}-d {arr.dtype} array, not a flat array of token ids",
                    "save a 1-d uint16/uint32 array")
            return arr
        size = p.stat().st_size
        require(size > 0 and size % self.dtype.itemsize == 0, key,
                f"{p} has {size} bytes, not a whole number of {self.dtype} tokens",
                "check data.dtype (uint16 vs uint32) or regenerate the file")
        return np.memmap(p, dtype=self.dtype, mode="r")

    def load(self) -> "TokenFileData":
        tokens = self._open("data.path", self.path)
        if self.val_path:
            self.train, self.val = tokens, self._open("data.val_path", self.val_path)
        else:
            self.train, self.val = _split(tokens, self.val_fraction)
        return self

    @property
    def max_token_id(self) -> int:
        # streamed over the memmap in chunks so a multi-GB file never sits in RAM at once
        top = 0
        for arr in (self.train, self.val):
            for i in range(0, len(arr), 1 << 26):
                top = max(top, int(arr[i:i + (1 << 26)].max()))
        return top
