"""Peak memory of the masked attention path (packed documents / context-parallel rows) against
the sequence length: query chunks recomputed in backward vs one explicit ``[S, S]`` mask.

    python benchmarks/attention_memory.py [--lengths 1024 2048 4096 8192] [--out bench_results/attention_memory.json]

Each measurement runs forward + backward of one attention layer (B 1, 8 query heads, 2 kv heads,
head dim 64, fp32, rows packed with 1024-token documents, so every row needs the document mask)
in a fresh process and reports the growth of its peak resident memory over what the inputs
already took. "chunked" is `causal_attention` (the library's path); "explicit mask" calls SDPA
once with the whole boolean mask, the path it replaced. Linear growth doubles the memory per
doubling of S; quadratic growth quadruples it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import resource, sys, torch
import torch.nn.functional as F
from dtensor_mimo.models.layers import causal_attention
s, variant = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
q = torch.randn(1, 8, s, 64, requires_grad=True)
k, v = (torch.randn(1, 2, s, 64, requires_grad=True) for _ in range(2))
pos = torch.arange(s).unsqueeze(0)
doc = (pos // 1024)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if variant == "chunked":
    out = causal_attention(q, k, v, q_pos=pos, kv_pos=pos, q_doc=doc, kv_doc=doc)
else:
    mask = (pos.unsqueeze(1) <= pos.unsqueeze(2)) & (doc.unsqueeze(1) == doc.unsqueeze(2))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), enable_gqa=True)
out.sum().backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


def peak_mib(length: int, variant: str) -> float:
    result = subprocess.run([sys.executable, "-c", CHILD, str(length), variant], check=True,
                            capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    return float(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--out", default="bench_results/attention_memory.json")
    args = parser.parse_args()
    rows = []
    print(f"{'S':>6} | {'chunked MiB':>11} | {'x prev':>6} | {'explicit mask MiB':>17} | {'x prev':>6} | explicit/chunked")
    for length in args.lengths:
        row = {"seq_len": length, "chunked_mib": peak_mib(length, "chunked"),
               "explicit_mib": peak_mib(length, "explicit")}
        prev = rows[-1] if rows else None
        growth = {k: (row[k] / prev[k] if prev and prev[k] > 0 else float("nan")) for k in ("chunked_mib", "explicit_mib")}
        print(f"{length:>6} | {row['chunked_mib']:>11.1f} | {growth['chunked_mib']:>6.2f} | "
              f"{row['explicit_mib']:>17.1f} | {growth['explicit_mib']:>6.2f} | "
              f"{row['explicit_mib'] / max(row['chunked_mib'], 1e-9):.1f}x")
        rows.append(row)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "heads": [8, 2], "head_dim": 64, "document": 1024}, f, indent=1)


if __name__ == "__main__":
    main()
