"""How long until a fault on one rank ends the whole job, on both launchers.

    python benchmarks/faults.py [--json faults.json] [--launchers own,torchrun] [--faults encoder,language,data,kill]

Each row is one short training run (the default 3-rank digits layout: vision @0, audio @1,
language @2) with `DTENSOR_MIMO_FAULT` making one rank fail in step 3: a raise in an encoder's
forward, in the language model's forward, in the batch's loading, or a SIGKILL. The fault prints
its wall-clock time when it fires. From then: "detected" until the launcher names the failure
(own launcher: its "error on rank" line; torchrun: its agent ending the other workers), "to exit"
until the launcher has exited (every rank gone, exit code non-zero), "peers" (own launcher) the
latest peer's error after the first failure, as the launcher reports it. The outcome column says
what the launcher named as the cause.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--train.steps", "6", "--data.batch_size", "8", "--pipeline.microbatches", "2",
       "--data.heldout_samples", "8", "--train.generate", "0", "--metrics.log_every", "1",
       "--lr_schedule.warmup_steps", "2", "--metrics.progress", "off",
       *[f"--options.{m}.compile=false" for m in ("vision", "audio", "language")]]
FAULTS = {"encoder": "encoder:3:0", "language": "language:3:2", "data": "data:3:1", "kill": "kill:3:1"}


def run(launcher: str, fault: str) -> dict:
    if launcher == "own":
        command = [sys.executable, "-m", "tests.inject_faults", *RUN]
    else:
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        command = [torchrun, "--standalone", "--nproc-per-node=3", "-m", "tests.inject_faults", *RUN]
    env = {**os.environ, "PYTHONPATH": REPO, "DTENSOR_MIMO_FAULT": FAULTS[fault]}
    lines: list[tuple[float, str]] = []  # stderr, each line stamped when it arrived
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                cwd=cwd, env=env)
        for line in proc.stderr:
            lines.append((time.time(), line.rstrip("\n")))
        code = proc.wait(timeout=600)
    ended = time.time()
    fired = next((float(m.group(1)) for _, line in lines
                  if (m := re.search(r"DTENSOR_MIMO_FAULT: .*\(at ([0-9.]+)\)", line))), None)
    # Detected: the launcher names the failure (own), or torchrun's agent ends the other workers.
    mark = r"^error" if launcher == "own" else r"Sending process .* closing signal|failed \(exitcode"
    seen = next((t for t, line in lines if re.search(mark, line)), None)
    peers = [float(x) for _, line in lines for x in re.findall(r"^then, on ranks? [0-9, ]+ \(\+([0-9.]+) s\)", line)]
    cause = next((line for _, line in lines if re.search(r"^error", line)), None) if launcher == "own" else \
        next((re.sub(r"^\[rank\d+\]: ", "", line) for _, line in lines
              if re.search(r"InjectedFault: |exitcode: -9", line)), None)
    return {"fault": fault, "injected": FAULTS[fault], "launcher": launcher, "exit_code": code,
            "detected_s": seen - fired if fired and seen else None,
            "to_exit_s": ended - fired if fired else None,
            "peers_noticed_s": max(peers) if peers else None,
            "outcome": (cause or lines[-1][1] if lines else "")[:120]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="faults.json")
    parser.add_argument("--launchers", default="own,torchrun")
    parser.add_argument("--faults", default=",".join(FAULTS))
    args = parser.parse_args()
    rows = []
    print(f"{'fault':<9} {'launcher':<9} {'exit':>4} {'detected':>9} {'to exit':>8} {'peers':>7}  outcome")
    for launcher in args.launchers.split(","):
        for fault in args.faults.split(","):
            r = run(launcher, fault)
            rows.append(r)
            cells = [f"{r[k]:.2f} s" if r[k] is not None else "-" for k in ("detected_s", "to_exit_s", "peers_noticed_s")]
            print(f"{fault:<9} {launcher:<9} {r['exit_code']:>4} {cells[0]:>9} {cells[1]:>8} {cells[2]:>7}  "
                  f"{r['outcome']}", flush=True)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
