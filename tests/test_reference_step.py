"""experiments/reference_step.py (the plain-PyTorch step trainer_vs_reference.py times ours against) computes
what core's model computes: given the same weights, the same loss and the same gradients."""
import torch

from core.model import ModelConfig, TransformerLM
from experiments.reference_step import LMShape, ReferenceLM, lm_loss, make_train_step

# core parameter name -> reference parameter name (per block, then outside the blocks)
BLOCK_NAMES = {"ln1.weight": "attn_norm.weight", "attn.qkv_proj.weight": "qkv.weight",
               "attn.output_proj.weight": "out.weight", "ln2.weight": "ffn_norm.weight",
               "ffn.w1.weight": "w1.weight", "ffn.w2.weight": "w2.weight", "ffn.w3.weight": "w3.weight"}
TOP_NAMES = {"token_embeddings.weight": "embed.weight", "final_norm.weight": "final_norm.weight",
             "lm_head.weight": "head.weight"}


def reference_name(core_name: str) -> str:
    if core_name.startswith("blocks."):
        _, layer, rest = core_name.split(".", 2)
        return f"blocks.{layer}.{BLOCK_NAMES[rest]}"
    return TOP_NAMES[core_name]


def twin_models():
    cfg = ModelConfig(d_model=32, d_ff=64, n_layers=2, n_heads=4, vocab_size=50, context_length=16)
    ours = TransformerLM(cfg)
    ours.init_weights(seed=0)
    with torch.no_grad():  # norms away from 1 so a misplaced norm weight shows
        for name, p in ours.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight", "final_norm.weight")):
                p.uniform_(0.5, 1.5)
    ref = ReferenceLM(LMShape(cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.n_heads, cfg.vocab_size), max_seq_len=16)
    ref_params = dict(ref.named_parameters())
    assert len(ref_params) == len(dict(ours.named_parameters()))
    with torch.no_grad():
        for name, p in ours.named_parameters():
            ref_params[reference_name(name)].copy_(p)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (3, 12), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (3, 12), generator=gen)
    return ours, ref, tokens, targets


def test_reference_and_core_agree_on_loss_and_gradients():
    ours, ref, tokens, targets = twin_models()
    loss_ours = lm_loss(ours, tokens, targets)
    loss_ref = lm_loss(ref, tokens, targets)
    torch.testing.assert_close(loss_ref, loss_ours, rtol=1e-6, atol=1e-6)
    loss_ours.backward()
    loss_ref.backward()
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(ref_params[reference_name(name)].grad, p.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_reference_step_trains():
    """The timed step (CPU: fp32, plain AdamW) lowers the loss on its fixed batch."""
    _, ref, tokens, targets = twin_models()
    step = make_train_step(ref, tokens, targets, lr=1e-2)
    losses = [step().item() for _ in range(5)]
    assert losses[-1] < losses[0] - 0.1
