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

from nvg.adam import OnePassAdam
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


def fit_block(block, params: dict, x, y, cos, sin, *, steps: int, batch: int, lr: float, autocast,
              generator: torch.Generator, trainer=None) -> dict:
    """`steps` Adam steps on `params` of `batch` rows drawn from `x` → `y`, the sign latents of `trainer` (when
    given) moving inside each backward pass. Returns the first and last batch loss, the step guards' lines and
    the matrix-steps whose sign gradient grad_clip scaled down."""
    opt = OnePassAdam(param_groups(params, relative=True), lr=lr)
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
    return {"first_loss": None if first is None else float(first), "last_loss": None if last is None else float(last),
            "guards": guard_lines, "grad_clipped": grad_clipped}


def reconstruct_block(block, x: torch.Tensor, y: torch.Tensor, cos, sin, *, steps: int, batch: int, lr: float,
                      autocast, generator: torch.Generator, signs=None) -> tuple[dict, torch.Tensor]:
    """Train `block` (in place) for `steps` Adam steps of `batch` rows drawn from `x` → `y` [n, t, d] (float32).
    `signs()`, when given, makes the block's `SignTrainer` (its sign matrices then train too).
    Returns the `token_error` over every row before and after (with signs: their statistics, the matrix-steps
    whose gradient grad_clip scaled down and the step guards' lines), and the block's output on `x` (the next
    block's input, so that it is computed once).
    When training made the error worse, the block's starting values, signs included, are put back; if its signs
    trained, the scales then train again alone from there (`signs_dropped`): on the H200 with a q2tp embedding
    (session 32) sign training ran away in 10 of 30 blocks, and each of them lost its scales' gain with its signs."""
    run = dict(steps=steps, batch=batch, lr=lr, autocast=autocast, generator=generator)
    params = block_trainable(block)
    start = {n: p.detach().clone() for n, p in params.items()}

    def train(trainer=None) -> tuple[dict, float, torch.Tensor]:
        """The fit's record (with the trainer's statistics), the error over every row after it, the output."""
        for p in params.values():
            p.requires_grad_(True)
        fit = fit_block(block, params, x, y, cos, sin, trainer=trainer, **run)
        for p in params.values():
            p.requires_grad_(False)
        if trainer is not None:
            fit["signs"] = trainer.stats()
            trainer.release()
        out = run_block(block, x, cos, sin, batch, autocast)
        return fit, float(token_error(out, y)), out

    @torch.no_grad()
    def put_back() -> None:
        for n, p in params.items():
            p.copy_(start[n])

    before = float(token_error(run_block(block, x, cos, sin, batch, autocast), y))
    trainer = signs() if signs is not None else None
    start_bits = trainer.snapshot() if trainer is not None else None
    if trainer is not None:
        sign_fit, after, out = train(trainer)
    signs_dropped = trainer is not None and after > before
    if signs_dropped:
        put_back()
        trainer.restore(start_bits)
    if trainer is None or signs_dropped:
        fit, after, out = train()
    else:
        fit = sign_fit
    kept = after <= before
    if not kept:
        put_back()
        out = run_block(block, x, cos, sin, batch, autocast)
    stats = {"before": before, "after": after if kept else before, "kept": kept,
             "first_loss": fit["first_loss"], "last_loss": fit["last_loss"]}
    if trainer is not None:
        sign_stats = sign_fit["signs"]
        stats["signs"] = {"flipped_fraction": 0.0 if signs_dropped else sign_stats["flipped_fraction"],
                          "churn": sign_stats["churn"], "eta": trainer.eta0 * trainer.counters["eta_mul"],
                          "spikes": sign_stats["spikes"], "grad_clipped": sign_fit["grad_clipped"],
                          "guards": sign_fit["guards"], "dropped": signs_dropped}
    return stats, out
