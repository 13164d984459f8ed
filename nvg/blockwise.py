"""Block-wise reconstruction (EfficientQAT's Block-AP, NanoQuant): one student block learns its scales
so that, fed the student's own hidden states, it outputs what the teacher's block outputs on the
teacher's.

The encoder fits every linear alone to its input Gram; a block of them, with attention, SwiGLU and the
errors of every block before it, drifts from the teacher's block. Here the block's trainable tensors
(h, ℓ, g of each BLR linear, the RMSNorm gains) minimise the per-token relative error
‖block(x_s) − y_t‖² / ‖y_t‖² over calibration windows, x_s the student's input (the blocks before already
reconstructed: the block also learns to undo the error it is handed), y_t the teacher's output on its
own input. Per token, because the next block sees each token's state through an RMSNorm: a plain MSE over
the residual stream is the error of the few tokens that carry a massive activation (on the CPU default
job's SmolLM2 student, from block 11 on it was 0.04 whatever the other tokens did, and blocks 12–27 then
trained on nothing). Adam with each tensor's step relative to its starting RMS (as `train.lr_relative`),
linear warm-up then cosine to zero.

With `reconstruct.signs` the block's sign matrices train too, through `nvg.sign_training`'s
straight-through latents on the same schedule: the encoder chose each sign for its linear alone under
the input Gram; here a sign may flip for what the block as a whole outputs, with the errors it is handed.
"""

from __future__ import annotations

import torch

from nvg.distill import lr_shape, param_groups


def is_trained(name: str) -> bool:
    """Whether reconstruction trains a block's parameter: the h, ℓ, g of a BLR linear or a norm gain."""
    return name.endswith((".h", ".ell", ".g")) or name.endswith("norm.weight")


def block_trainable(block: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The tensors reconstruction trains, made trainable (everything else in the block frozen)."""
    params = {}
    for name, p in block.named_parameters():
        keep = is_trained(name)
        p.requires_grad_(keep)
        if keep:
            params[name] = p
    return params


@torch.no_grad()
def run_block(block, x: torch.Tensor, cos, sin, batch: int, autocast) -> torch.Tensor:
    """The block's float32 output on every row of `x` [n, t, d], `batch` rows at a time."""
    out = torch.empty_like(x)
    for s in range(0, len(x), batch):
        with autocast:
            out[s : s + batch] = block(x[s : s + batch], cos, sin).float()
    return out


def token_error(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean over tokens of ‖out − y‖² / ‖y‖² (float32)."""
    return ((out.float() - y).pow(2).sum(-1) / y.pow(2).sum(-1).clamp_min(1e-30)).mean()


def reconstruct_block(block, x: torch.Tensor, y: torch.Tensor, cos, sin, *, steps: int, batch: int, lr: float,
                      autocast, generator: torch.Generator, signs=None) -> tuple[dict, torch.Tensor]:
    """Train `block` (in place) for `steps` Adam steps of `batch` rows drawn from `x` → `y` [n, t, d] (float32).
    `signs()`, when given, makes the block's `SignTrainer` (its sign matrices then train too).
    Returns the `token_error` over every row before and after (with signs: their statistics, the matrix-steps
    whose gradient grad_clip scaled down and the step guards' lines), and the block's output on `x` (the next
    block's input, so that it is computed once); when
    training made the error worse (it should not), the block's starting values, signs included, are put back."""
    params = block_trainable(block)
    start = {n: p.detach().clone() for n, p in params.items()}
    before = float(token_error(run_block(block, x, cos, sin, batch, autocast), y))
    trainer = signs() if signs is not None else None
    start_bits = trainer.snapshot() if trainer is not None else None
    opt = torch.optim.Adam(param_groups(params, relative=True), lr=lr, fused=x.is_cuda)
    first = last = None
    guard_lines = []  # what the sign step guards did, step by step
    grad_clipped = 0  # matrix-steps whose sign gradient grad_clip scaled down
    for step in range(1, steps + 1):
        rows = torch.randint(len(x), (batch,), generator=generator).to(x.device)
        if trainer is not None:
            trainer.begin_step(lr_shape(step, steps), 1.0)
        with autocast:
            out = block(x[rows], cos, sin)
        loss = token_error(out, y[rows])
        loss.backward()  # the sign latents move inside it, bucket by bucket
        if trainer is not None:
            step_stats = trainer.end_step()
            grad_clipped += step_stats["grad_clipped"]
            guard_lines += [f"step {step}: {line}" for line in trainer.after_step(step_stats)[2]]
        for group in opt.param_groups:
            group["lr"] = lr * lr_shape(step, steps) * group["lr_scale"]
        opt.step()
        opt.zero_grad(set_to_none=True)
        first, last = first if first is not None else loss.detach(), loss.detach()
    sign_stats = trainer.stats() if trainer is not None else None
    for p in params.values():
        p.requires_grad_(False)
    if trainer is not None:
        trainer.release()
    out = run_block(block, x, cos, sin, batch, autocast)
    after = float(token_error(out, y))
    kept = after <= before
    if not kept:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(start[n])
            if trainer is not None:
                trainer.restore(start_bits)
        out = run_block(block, x, cos, sin, batch, autocast)
    stats = {"before": before, "after": after if kept else before, "kept": kept,
             "first_loss": None if first is None else float(first), "last_loss": None if last is None else float(last)}
    if sign_stats is not None:
        stats["signs"] = {"flipped_fraction": sign_stats["flipped_fraction"] if kept else 0.0,
                          "churn": sign_stats["churn"], "eta": trainer.eta0 * trainer.counters["eta_mul"],
                          "spikes": sign_stats["spikes"], "grad_clipped": grad_clipped, "guards": guard_lines}
    return stats, out
