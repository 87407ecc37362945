"""Plan a model in Python and train it with the plan: the front doors end to end.

    torchrun --nproc-per-node 2 examples/train_llama.py        # 2 CPU ranks (gloo), or 2 GPUs (NCCL)

Every rank builds the same model (a small Llama with random weights, from its transformers config)
and the same batch, captures the model's graph (``shardplan.capture``), finds the fastest plan for
the ranks at hand (``solve`` on the analytic cost model of a DGX-A100 node), lays the model on a
device mesh with that plan (``shardplan.apply``) and trains a few steps. Rank 0 prints the plan's
splits and every step's loss, the first next to the single-device model's (``shardplan run --check``
compares every gradient too).
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import shardplan
from shardplan.capture.models import build
from shardplan.cluster import get_cluster
from shardplan.cost.analytic import AnalyticCostModel
from shardplan.cost.tables import build_tables
from shardplan.execute.apply import choose_mesh
from shardplan.execute.worker import rank_device
from shardplan.plan import Plan
from shardplan.search import solve


def main() -> None:
    device = rank_device()  # this rank's GPU (LOCAL_RANK) where torch sees GPUs, else the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    ranks, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)  # the same weights and batch on every rank
    module, batch = build("llama", batch=8, seq=64, device=device)  # or your own nn.Module and a batch

    with torch.no_grad():
        single = module(**batch).logits.pow(2).mean().item()  # the first step's loss on one device
    graph = shardplan.capture(module, (), batch, name="llama")
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=ranks)), ranks)
    plan = Plan.from_choice(tables, solve(tables).choice)
    mesh = init_device_mesh(device.type, choose_mesh(graph, plan))
    parallel = shardplan.apply(module, plan, mesh, graph=graph)
    if rank == 0:
        split = {op.name: {d: f for d, f in op.split if f > 1} for op in plan.ops if op.devices > 1}
        print(f"{len(split)} of {len(plan.ops)} ops split over {ranks} ranks, mesh {tuple(mesh.shape)}; "
              f"e.g. {next(iter(split.items()), None)}")

    for step in range(3):
        logits = parallel(**batch).logits
        loss = logits.full_tensor().pow(2).mean()  # a stand-in loss on the gathered logits
        with parallel.context():
            loss.backward()
            parallel.reduce_gradients()  # the data-parallel sums, bucketed as DDP does
            with torch.no_grad():  # plain SGD on the distributed parameters
                for p in module.parameters():
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-1e-3)
                        p.grad = None
        if rank == 0:
            print(f"step {step}: loss {loss.item():.9g}" + (f" (one device: {single:.9g})" if step == 0 else ""))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
