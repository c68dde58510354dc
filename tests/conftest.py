"""Shared test set-up: CPU stands in for the GPU."""
import os

import torch

# Triton kernels run under the interpreter on CPU-only machines; this must happen before
# anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
