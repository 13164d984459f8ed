"""Adam over many parameter groups in one multi-tensor pass.

`train.lr_relative` (and `reconstruct_blocks`' fits) give every trainable tensor its own group, so that each
moves at its own rate (`distill.param_groups`): 692 groups for a SmolLM2 student. torch's Adam steps group
by group, each with its own Python bookkeeping and kernel launches (fused: the update and the step counter,
two a group), in a training step that is host-bound on the GPU (docs/benchmarks.md). Here every group's
tensors go through the same seven `torch._foreach_*` calls at once, each tensor with its own step size, so
the host work of an update no longer grows with the number of groups: a SmolLM2 student's 691 trainable
tensors in 691 groups took 11–13 ms an update on a 2-core CPU, against 22–24 ms for torch's fused Adam and
69–71 ms for its foreach one (`bench/adam_groups.py`, three runs, session 48). On CUDA it is seven multi-tensor
launches per chunk of tensors, where torch's fused Adam makes two launches a group. (With the 28.3M-entry
embedding trained too, the CPU's seven passes over it cost more than fused Adam's one: 100 ms against 38.)

The arithmetic is torch's foreach Adam's (no weight decay, no amsgrad), op for op, so on the CPU the result
is bit for bit torch's with the same groups; the state is kept as torch keeps it (`step`, `exp_avg`,
`exp_avg_sq` per tensor), so a saved run state loads into either.
"""

from __future__ import annotations

import torch


class OnePassAdam(torch.optim.Optimizer):
    """Adam whose groups (each with its own `lr`) are stepped together. β and ε are shared by all groups."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})
        if any(g["betas"] != betas or g["eps"] != eps for g in self.param_groups):
            raise ValueError("OnePassAdam: betas and eps are shared by every group")

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, with every step count on the CPU: a state saved by torch's fused Adam (train_student's before
        session 48) keeps them on the GPU, where reading them back would sync once a tensor."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            state["step"] = state["step"].cpu()

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "OnePassAdam takes no closure"
        params, grads, exp_avgs, exp_avg_sqs, steps, lrs = [], [], [], [], [], []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # as torch's Adam starts a tensor (its step a float32 scalar on the CPU)
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
                lrs.append(group["lr"])
        if not params:
            return None
        beta1, beta2 = self.defaults["betas"]
        torch._foreach_add_(steps, 1)  # CPU scalars: no launch
        counts = torch.stack(steps).tolist()  # one read, not one a tensor
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        denominators = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denominators, [(1 - beta2**t) ** 0.5 for t in counts])
        torch._foreach_add_(denominators, self.defaults["eps"])
        torch._foreach_addcdiv_(params, exp_avgs, denominators, [-(lr / (1 - beta1**t)) for lr, t in zip(lrs, counts)])
        return None
