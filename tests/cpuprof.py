"""A pytest plugin: wall, user and system CPU seconds of each test, its rank processes and launchers included.

    CPUPROF_OUT=suite_cpu.json python -m pytest -p tests.cpuprof

The CPU of every process under pytest is read from /proc (Linux) before and after each test: the
harness's long-lived rank processes, torchrun and the trainer's ranks, and what they reaped. Where
the suite's time goes on a small machine is then a sort of the JSON away (docs/testing.md). Under
pytest-xdist (``-n 2``, as `make test` runs) each test process writes its own file, named with its
worker id (``suite_cpu-gw0.json``, ...); a test's CPU is then its own process tree's.
"""

from __future__ import annotations

import json
import os
import time

_TICK = os.sysconf("SC_CLK_TCK")
_start: dict[str, tuple[float, float, float]] = {}
_rows: list[dict[str, float | str]] = []


def _tree_cpu() -> tuple[float, float]:
    """(user, system) CPU seconds of this process and its descendants, living and reaped."""
    children: dict[int, list[int]] = {}
    times: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
        times[int(entry)] = [int(x) for x in fields[11:15]]  # utime stime cutime cstime
    todo, user, system = [os.getpid()], 0, 0
    while todo:
        pid = todo.pop()
        if pid in times:
            u, s, cu, cs = times[pid]
            user, system = user + u + cu, system + s + cs
        todo.extend(children.get(pid, []))
    return user / _TICK, system / _TICK


def pytest_runtest_setup(item) -> None:
    _start[item.nodeid] = (time.time(), *_tree_cpu())


def pytest_runtest_teardown(item, nextitem) -> None:
    started = _start.pop(item.nodeid, None)
    if started is None:  # skipped in setup
        return
    (t0, u0, s0), (u1, s1) = started, _tree_cpu()
    _rows.append({"test": item.nodeid, "wall": time.time() - t0, "user": u1 - u0, "sys": s1 - s0})


def pytest_sessionfinish(session) -> None:
    out = os.environ.get("CPUPROF_OUT")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if out and worker:  # under pytest-xdist (make test): one file per test process; its controller runs none
        root, ext = os.path.splitext(out)
        out = f"{root}-{worker}{ext}"
    if out and (worker or not _is_xdist_controller(session)):
        with open(out, "w") as f:
            json.dump(sorted(_rows, key=lambda r: -r["wall"]), f, indent=0)


def _is_xdist_controller(session) -> bool:
    return getattr(session.config.option, "numprocesses", None) not in (None, 0)
