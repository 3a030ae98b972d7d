"""Main job: a heterogeneous MIMO layout on 8 CPU ranks (gloo).

    torchrun --standalone --nproc-per-node=8 examples/train_mimo.py
"""

import torch.distributed as dist

from dtensor_mimo import MimoLayout, Parallelism


def main() -> None:
    dist.init_process_group("gloo")
    layout = MimoLayout({
        "vision": Parallelism(dp=4),
        "language": Parallelism(tp=2, dp=2),
    })
    layout.init_meshes("cpu")
    rank = dist.get_rank()
    if rank == 0:
        print(layout.describe(), flush=True)
    mods = layout.modules_on(rank)
    coords = {m: layout.coordinate(m, rank) for m in mods}
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, f"rank {rank}: {coords}")
    if rank == 0:
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
