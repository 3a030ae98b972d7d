"""Peak memory and time of the language model's loss: the head and cross entropy in chunks
(`ParallelOptions(chunked_loss=True)`, the default) against plain ``[tokens, vocab]`` logits.

    python benchmarks/loss_memory.py [--vocabs 32000 128256] [--tokens 2048] [--compiled] [--loss-share 0.42]
                                     [--out bench_results/loss_memory.json]

Each case builds a small `Llama` (dim 256, 2 layers) through `MimoModel` (world 1, gloo) in a
fresh process, and runs forward + backward of one batch of `--tokens` tokens (one row): the
growth of the process's peak resident memory over what model and batch already took (the first
pass), then the median time of three more passes. The vocabulary sets the logits' size: at
32,000 and 4,096 tokens they are 131M values (524 MB in fp32, two chunks), at Llama 3's 128,256 four times
that. The plain path holds the fp32 log-softmax of all logits until backward and then their fp32
gradient and its bf16/fp32 copy; the chunked one holds one chunk of fp32 logits at a time.
`--compiled` adds both paths with ``ParallelOptions(compile=True)`` (inductor): the blocks, and
for the chunked one each chunk's arithmetic after its matmul fused (`linear_token_loss_sum`'s
``compile_backend``); its memory and time are compared with the compiled plain path.
`--loss-share F`: only the last F of the row's positions carry a loss weight (a masked prompt
before them, as in supervised fine-tuning); the chunked head then runs on those positions only
(counted on the host), and a "chunked all rows" case runs it on every row as before, to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = r"""
import os, resource, statistics, sys, time
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[4], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                  LOCAL_WORLD_SIZE="1")
import torch
from dtensor_mimo import MimoLayout, MimoModel, ParallelOptions, Parallelism, init_distributed
from dtensor_mimo.data import MimoBatch
from dtensor_mimo.models import Llama, LlamaConfig
vocab, tokens, case, share = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[5])
if "all rows" in case:  # the head on every row: the host count of loss rows not passed on
    from dtensor_mimo.schedule.language import LanguagePipeline
    LanguagePipeline._count_loss_rows = lambda self, mb: None
init_distributed("cpu")
torch.manual_seed(0)
llama = Llama(LlamaConfig(vocab_size=vocab, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=512,
                          max_seq_len=tokens))
model = MimoModel(MimoLayout({"language": Parallelism()}), llama, {},
                  options={"language": ParallelOptions(chunked_loss=case.startswith("chunked"),
                                                       compile=case.endswith("compiled"))})
ids = torch.randint(0, vocab, (1, tokens + 1))
mask = torch.ones(1, tokens)
mask[:, :round(tokens * (1 - share))] = 0  # a prompt without loss
batch = MimoBatch(ids[:, :-1], ids[:, 1:], loss_mask=mask)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
model(batch).backward()
peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
times = []
for _ in range(3):
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    model(batch).backward()
    times.append(time.perf_counter() - t0)
print(peak, statistics.median(times))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[32000, 128256])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--compiled", action="store_true",
                    help="also both compiled (inductor: the blocks, and the chunks' arithmetic fused)")
    ap.add_argument("--loss-share", type=float, default=1.0,
                    help="the share of positions with a loss weight (the rest a masked prompt); below 1 "
                         "also the chunked head on every row")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_results", "loss_memory.json"))
    args = ap.parse_args()
    rows = []
    env = {**os.environ, "PYTHONPATH": ROOT}
    print(f"{'vocab':>8}{'logits MB (fp32)':>18}{'case':>18}{'peak growth MB':>16}{'fwd+bwd s':>11}{'memory vs plain':>17}")
    for vocab in args.vocabs:
        got = {}
        cases = ("plain", "chunked", *(("chunked all rows",) if args.loss_share < 1 else ()),
                 *(("plain compiled", "chunked compiled") if args.compiled else ()))
        for case in cases:
            out = subprocess.run([sys.executable, "-c", CHILD, str(vocab), str(args.tokens), case, "29571",
                                  str(args.loss_share)],
                                 capture_output=True, text=True, env=env, check=True)
            peak, seconds = map(float, out.stdout.split())
            got[case] = peak
            ratio = peak / got["plain compiled" if "compiled" in case else "plain"]
            rows.append({"vocab": vocab, "tokens": args.tokens, "loss_share": args.loss_share, "case": case,
                         "peak_growth_mb": peak, "fwd_bwd_s": seconds})
            print(f"{vocab:>8}{vocab * args.tokens * 4 / 1e6:>18.0f}{case:>18}{peak:>16.0f}{seconds:>11.2f}{ratio:>16.2f}x",
                  flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
