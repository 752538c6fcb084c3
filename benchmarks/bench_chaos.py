"""The chaos soak: the suite's chaos test (tests/sweep/test_chaos.py) over N fault schedules, one
Dask sweep each under its seeded faults (workers SIGKILLed and restarted, one frozen until its task
reruns elsewhere and resumed, the scheduler and the MLflow server restarted), rerun to the end and
held against an undisturbed sweep on the same cluster. Reports each schedule's faults, attempts,
wall time and outcome; a failure's seed replays it (BATCHLAB_CHAOS_SEEDS=<seed>).

    python benchmarks/bench_chaos.py            # schedules 1..20
    BATCHLAB_CHAOS_N=40 python benchmarks/bench_chaos.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import REPO, Table, cli_env, markdown, progress, verdict

N = int(os.environ.get("BATCHLAB_CHAOS_N", "20"))
TARGET = 20  # the soak: at least 20 schedules, every one ending as an undisturbed sweep
SHORT = {"kill-worker": "kill", "freeze-worker": "freeze", "restart-mlflow": "mlflow", "restart-scheduler": "scheduler"}


def main() -> dict[str, Any]:
    seeds = list(range(1, N + 1))
    with tempfile.TemporaryDirectory(prefix="batchlab-chaos-") as tmp:
        base = Path(tmp) / "pytest"
        progress(f"chaos: {N} fault schedules, one Dask sweep each (about 90 s a schedule)")
        started, load_start = time.perf_counter(), os.getloadavg()[0]
        cmd = [sys.executable, "-m", "pytest", "tests/sweep/test_chaos.py", "-q", "-p", "no:cacheprovider",
               f"--basetemp={base}"]  # fmt: skip
        env = cli_env(BATCHLAB_CHAOS_SEEDS=",".join(map(str, seeds)))
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - started
        failed = {}  # seed: the first line of why (pytest's short summary: "FAILED <test>[<seed>] - <why>")
        for line in proc.stdout.splitlines():
            if line.startswith("FAILED") and "[" in line:
                test, _, why = line.partition(" - ")
                failed[int(test.rsplit("[", 1)[1].rstrip("]"))] = why.split("; fired:")[-1][:160]
        records = {r["seed"]: r for r in (json.loads(p.read_text()) for p in base.rglob("chaos.json"))}
    table = Table(f"Chaos soak: {N} fault schedules on one Dask sweep each (12 experiments, 2 workers)",
                  ["schedule", "faults, in order", "sweep attempts", "copies that waited for a claim", "seconds",
                   "ends as undisturbed"])  # fmt: skip
    for seed in seeds:
        r = records.get(seed, {})
        faults = " → ".join(SHORT.get(k, k) for k in r.get("schedule", [])) or "(did not start)"
        ok = f"NO: {failed[seed]}" if seed in failed else "NO: did not run" if not r else "yes"
        table.add(seed, faults, r.get("attempts", ""), r.get("claim_waits", ""), r.get("seconds", ""), ok)
    passed = sum(1 for s in seeds if s in records and s not in failed)
    summary = Table("Chaos target", ["target", "measured", "result"])
    summary.add(f"≥ {TARGET} schedules, all ending as an undisturbed sweep", f"{passed} of {N}",
                verdict(N >= TARGET and passed == N))  # fmt: skip
    tables = [table.as_dict(), summary.as_dict()]
    print(markdown(tables))
    if proc.returncode not in (0, 1):
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
    return {"schedules": N, "passed": passed, "failed": failed, "wall_s": wall,
            "load_average_start": load_start, "load_average_end": os.getloadavg()[0], "tables": tables}  # fmt: skip


if __name__ == "__main__":
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    main()
