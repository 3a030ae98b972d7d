"""What a checkpoint's manifest costs: DCP's save against the manifest's checksums and a verify.

    python benchmarks/checksum.py [--mib 100] [--repeat 3] [--json checksum.json]

One process (a gloo world of 1) saves a state of `--mib` MiB of float32 tensors with DCP, then
times `write_manifest` (size + streamed CRC-32 of every file, the manifest fsynced) right after the
save and again warm, the CRC-32s alone, and `verify` (sizes only; sizes and checksums). Page cache
warm: the files were just written, as they are after a save; a verify after a restart reads from
disk and costs what reading the checkpoint costs. Right after a save the manifest's fsync may wait
for the save's own data to reach the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dtensor_mimo.train.checkpoint import file_crc32, verify, write_manifest


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default="checksum.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        numel = args.mib * 2**20 // 4 // 8
        state = {f"t{i}": torch.randn(numel) for i in range(8)}
        path = os.path.join(d, "ckpt")
        pairs = []  # a save, then its manifest at once (as `checkpoint.save` does)
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            dcp.save(state, checkpoint_id=path)
            t1 = time.perf_counter()
            write_manifest(path)
            pairs.append((t1 - t0, time.perf_counter() - t1))
        save_s, after_save_s = min(pairs)
        size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
        files = [os.path.join(path, n) for n in os.listdir(path)]
        crc_s = best(lambda: [file_crc32(f) for f in files], args.repeat)
        manifest_s = best(lambda: write_manifest(path), args.repeat)
        sizes_s = best(lambda: verify(path, checksums=False), args.repeat)
        full_s = best(lambda: verify(path), args.repeat)
        dist.destroy_process_group()
    rows = {"bytes": size, "dcp_save_s": save_s, "manifest_after_save_s": after_save_s, "crc_s": crc_s,
            "write_manifest_s": manifest_s, "verify_sizes_s": sizes_s, "verify_checksums_s": full_s,
            "crc_gib_per_s": size / crc_s / 2**30}
    print(f"{'checkpoint':<34} {size / 2**20:>9.1f} MiB")
    for name, key in (("dcp.save", "dcp_save_s"), ("manifest right after the save", "manifest_after_save_s"),
                      ("CRC-32 of every file", "crc_s"), ("manifest (warm, fsync included)", "write_manifest_s"),
                      ("verify: sizes", "verify_sizes_s"), ("verify: sizes + checksums", "verify_checksums_s")):
        print(f"{name:<34} {rows[key] * 1e3:>9.2f} ms")
    print(f"{'CRC-32 throughput':<34} {rows['crc_gib_per_s']:>9.2f} GiB/s")
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
