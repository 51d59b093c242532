"""NCCL's all-reduce of a [H] f32 vector across R GPUs, timed per call
(PyTorch's process group, one process per GPU, NVLink SHARP off by
NCCL_NVLS_ENABLE=0): the host-launched reference for the in-kernel
exchange of ar.cu. Prints one RESULT line (rank 0)."""
import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, ranks, hidden, iters):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29513")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=ranks)
    x = torch.randn(hidden, device="cuda")
    for _ in range(50):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dist.all_reduce(x)
    end.record()
    torch.cuda.synchronize()
    if rank == 0:
        print(f"RESULT nccl ranks={ranks} hidden={hidden} iters={iters} "
              f"us_per_call={start.elapsed_time(end) * 1e3 / iters:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=2000)
    a = ap.parse_args()
    mp.spawn(worker, args=(a.ranks, a.hidden, a.iters), nprocs=a.ranks)
