"""Data parallelism for `train_student` under `torchrun` (one process per GPU; gloo on the CPU).

Every process holds the whole student and takes an equal slice of each batch. After the backward pass
the gradients are averaged with one all-reduce of a single flat buffer. The trainable tensors are only
scales and norm gains (a few MB even for a 1B model), so overlapping that all-reduce with the backward
pass, as DDP's bucketed hooks do, would gain nothing. Every process then holds the same gradients, so
the Adam steps, the skip decisions and the best snapshots agree without broadcasts. Process 0 alone
writes state, metrics and outputs."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Group:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def device(self, device: torch.device) -> torch.device:
        """The process's own GPU when torchrun started several on CUDA."""
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if device.type == "cuda" and self.world > 1 else device

    def shard(self, rows: list[int]) -> list[int]:
        return rows[self.rank :: self.world]

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(values)
        return values

    def any(self, flag: bool, device: torch.device) -> bool:
        """Whether `flag` is set in any process: every process gets the same answer."""
        if self.world == 1:
            return flag
        votes = torch.tensor([float(flag)], device=device)
        dist.all_reduce(votes)
        return bool(votes.item())

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def average_grads(self, grads: list[torch.Tensor]) -> None:
        if self.world == 1:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def start(device: torch.device) -> Group:
    """Join the torchrun group (NCCL on GPUs, gloo on the CPU), or a group of one without torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Group()
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Group(dist.get_rank(), world)


def stop(group: Group) -> None:
    if group.world > 1:
        dist.destroy_process_group()
