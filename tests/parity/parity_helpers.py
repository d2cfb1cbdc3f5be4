"""Shared by the TRL parity tests: fresh leaf tensors, a loss-and-gradient comparison at 1e-5, and the one-process
accelerator TRL's trainer methods are called with."""

import torch

TOL = dict(rtol=0, atol=1e-5)


def leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


def assert_loss_and_grads_match(ours: torch.Tensor, theirs: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    torch.testing.assert_close(ours, theirs, **TOL)
    ours_grads = torch.autograd.grad(ours, inputs, retain_graph=True)
    theirs_grads = torch.autograd.grad(theirs, inputs)
    for mine, ref in zip(ours_grads, theirs_grads, strict=True):
        torch.testing.assert_close(mine, ref, **TOL)


class IdentityAccelerator:
    """What a TRL trainer method reads of its accelerator, on one process: gathers and reductions are the identity."""

    device = torch.device("cpu")
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x
