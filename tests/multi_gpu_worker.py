"""One rank of the DistributedDataParallel test in test_multi_gpu.py (spawned, one per GPU).

Each rank trains the same small model twice from the same initial weights, once with kbuild's
norms and once with torch's, on batches of its own, and writes what the test checks to
`out_dir/rank{rank}.pt`: the loss curve, the final parameters, whether every rank held the
same gradients after DDP's all-reduce, and the KBUILD_* environment it ran with. It lives in
its own importable module because `torch.multiprocessing.spawn` pickles the function by name.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import kbuild
from kbuild.cases import TRAIN_N

# NVLink multicast can take the host's shared GPUs out of service: off in every process.
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
STEPS = 5
BATCH = 32
LR = 0.5
EPS_RMS = 1e-6  # the eps the "tests" manifest warmed for RMSNorm and the fused form
KINDS = ("kbuild", "torch")


class Block(torch.nn.Module):
    """rmsnorm -> linear -> add the input and rmsnorm (fused) -> linear -> layernorm.

    `kind` picks kbuild's norms or torch's; parameter names, shapes and initialisation are the
    same for both, so one state_dict serves either.
    """

    def __init__(self, kind: str, n: int = TRAIN_N):
        super().__init__()
        self.kind = kind
        nn = kbuild.nn if kind == "kbuild" else torch.nn
        self.norm_in = nn.RMSNorm(n, eps=EPS_RMS)
        self.fc1 = torch.nn.Linear(n, n)
        self.add_weight = torch.nn.Parameter(torch.ones(n))
        self.fc2 = torch.nn.Linear(n, n)
        self.norm_out = nn.LayerNorm(n)
        with torch.no_grad():  # weights away from 1 and biases away from 0 give real gradients
            for p in (self.norm_in.weight, self.add_weight, self.norm_out.weight):
                p.uniform_(0.5, 1.5)
            self.norm_out.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(self.norm_in(x))
        if self.kind == "kbuild":
            normed, residual = kbuild.fused_add_rmsnorm(h, x, self.add_weight, eps=EPS_RMS)
        else:
            residual = h + x
            normed = F.rms_norm(residual, (residual.shape[-1],), self.add_weight, EPS_RMS)
        return self.norm_out(self.fc2(normed) + residual)


def batch(rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed (input, target) pair per rank and step, the same for both kinds of model."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn((BATCH, TRAIN_N), generator=g)
    target = torch.randn((BATCH, TRAIN_N), generator=g)
    return x.to(device), target.to(device)


def _flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _train(kind: str, initial: dict, rank: int, world_size: int, device: torch.device) -> dict:
    model = Block(kind).to(device)
    model.load_state_dict(initial)
    ddp = DistributedDataParallel(model, device_ids=[device.index])
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    losses, grads_equal = [], []
    for step in range(STEPS):
        x, target = batch(rank, step, device)
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(ddp(x), target)
        loss.backward()
        grads = _flat_grads(model)
        gathered = [torch.empty_like(grads) for _ in range(world_size)]
        dist.all_gather(gathered, grads)
        grads_equal.append([torch.equal(gathered[0], g) for g in gathered])
        opt.step()
        losses.append(loss.item())
    params = {name: p.detach().cpu() for name, p in model.named_parameters()}
    return {"losses": losses, "grads_equal": grads_equal, "params": params}


def train(rank: int, world_size: int, kbuild_env: dict[str, str], out_dir: str) -> None:
    """The body of rank `rank`: cuda:`rank`, NCCL, both models, results to out_dir."""
    # Inherited through os.environ already; set again so no start method can lose them.
    os.environ.update(kbuild_env)
    os.environ.update(MULTICAST_OFF)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False  # both models multiply in full fp32
    dist.init_process_group(
        "nccl",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=2),
        device_id=device,
    )
    try:
        torch.manual_seed(0)
        initial = Block("torch").state_dict()
        results = {kind: _train(kind, initial, rank, world_size, device) for kind in KINDS}
        results["initial"] = {name: t.clone() for name, t in initial.items()}
        results["env"] = {k: v for k, v in os.environ.items() if k.startswith("KBUILD_")}
        results["env"].update({k: os.environ.get(k) for k in MULTICAST_OFF})
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
