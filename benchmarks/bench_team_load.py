"""Many runs at once against one MLflow server on PostgreSQL (issue #31): N writer processes, each
one batchlab run logging EPOCHS epochs of METRICS metrics through batchlab's tracker (flushed every
epoch, so each epoch is one log call to the server), released together at a barrier. Counted
afterwards from the store: points stored against points sent, runs FINISHED; timed in each writer:
the latency of each log call (p50/p95/p99). Then the same with the server SIGKILLed mid-load and
started again RESTART_AFTER_S later (the calls that wait on the outage are in the tail).

Needs PostgreSQL at 127.0.0.1:5432 (trust auth, user postgres), as the tests do."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from common import Table, markdown, progress

SIZES = (8, 16, 32)
EPOCHS, METRICS = 30, 8
WORKERS = 4  # the server's --workers: MLflow's default
KILL_AFTER_S, RESTART_AFTER_S = 1.0, 5.0
# how long a run's end waits for the server to answer (BATCHLAB_TRACKING_WAIT_S, default 30 s): a
# restarted `mlflow server` with 4 workers took over 30 s to answer on this 2-core machine under
# 8 writers, and the runs then ended keeping their last points for the next command to replay
FINAL_WAIT_S = 180


def _writer(uri: str, name: str, barrier: Any, out: Any, going: Any, folder: str) -> None:
    os.chdir(folder)  # what a run could not record is kept under .batchlab/ here, not in the repo
    os.environ["BATCHLAB_TRACKING_WAIT_S"] = str(FINAL_WAIT_S)
    from batchlab import tracking
    from batchlab.config import TrackingConfig

    tracking.quiet_mlflow()
    latencies = []
    try:
        with tracking.run(TrackingConfig(enabled=True, experiment="load", tracking_uri=uri), name=name) as t:
            with contextlib.suppress(threading.BrokenBarrierError):  # a writer that died at start
                barrier.wait(timeout=300)
            going.set()
            for epoch in range(1, EPOCHS + 1):
                started = time.perf_counter()
                t.log_epoch({f"m{k}": epoch + k / 10 for k in range(METRICS)}, step=epoch)
                t.flush()
                latencies.append(time.perf_counter() - started)
                time.sleep(0.05)  # an epoch's training
        out.put((name, "ok", latencies))
    except Exception as err:
        out.put((name, f"{type(err).__name__}: {str(err)[:200]}", latencies))


class Server:
    def __init__(self, folder: Path, db: str, port: int) -> None:
        self.folder, self.db, self.port, self.proc = folder, db, port, None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--workers", str(WORKERS), "--backend-store-uri", f"postgresql://postgres@127.0.0.1:5432/{self.db}",
               "--artifacts-destination", str(self.folder / "artifacts")]  # fmt: skip
        with open(self.folder / "server.log", "a") as log:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        from batchlab import tracking

        deadline = time.monotonic() + 300
        while True:
            try:
                tracking.check_reachable(f"http://127.0.0.1:{self.port}", timeout_s=1)
                return
            except tracking.TrackingUnavailable:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    log = (self.folder / "server.log").read_text()[-2000:]
                    raise RuntimeError(f"mlflow server did not start: {log}") from None
                time.sleep(0.5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def _one(n: int, restart: bool) -> dict[str, Any]:
    import psycopg2
    from mlflow import MlflowClient

    db = f"batchlab_load_{uuid.uuid4().hex[:8]}"
    admin = psycopg2.connect(host="127.0.0.1", port=5432, user="postgres", dbname="postgres")
    admin.autocommit = True
    admin.cursor().execute(f"CREATE DATABASE {db}")
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = Server(Path(tmp), db, port)
        uri = f"http://127.0.0.1:{port}"
        try:
            server.start()
            context = multiprocessing.get_context("spawn")
            barrier, out, going = context.Barrier(n), context.Queue(), context.Event()
            args = [(uri, f"w{i}", barrier, out, going, tmp) for i in range(n)]
            procs = [context.Process(target=_writer, args=a) for a in args]
            for p in procs:
                p.start()
            if restart:
                going.wait(timeout=600)  # every writer's run is open
                time.sleep(KILL_AFTER_S)  # a few epochs in
                server.kill()
                time.sleep(RESTART_AFTER_S)
                try:
                    server.start()
                except RuntimeError:  # its workers timed out while 32 writers retried: once more
                    server.kill()
                    server.start()
            answers = [out.get(timeout=900) for _ in procs]
            for p in procs:
                p.join(timeout=60)
            client = MlflowClient(uri)
            runs = client.search_runs([client.get_experiment_by_name("load").experiment_id])
            stored = sum(len(client.get_metric_history(r.info.run_id, f"m{k}")) for r in runs for k in range(METRICS))
            latencies = sorted(x for _, _, lat in answers for x in lat)
            saved = Path(tmp).glob(".batchlab/unrecorded/*.json")
            kept = sum(len(json.loads(f.read_text()).get("metrics", [])) for f in saved)
        finally:
            server.kill()
            admin.cursor().execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
            admin.close()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000 if latencies else float("nan")

    return {"n": n, "restart": restart, "sent": n * EPOCHS * METRICS, "stored": stored, "kept_unrecorded": kept,
            "finished": sum(r.info.status == "FINISHED" for r in runs), "failed": [a for a in answers if a[1] != "ok"],
            "p50_ms": pct(0.5), "p95_ms": pct(0.95), "p99_ms": pct(0.99),
            "median_ms": statistics.median(latencies) * 1000 if latencies else float("nan")}  # fmt: skip


def tabulate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The results as run_all keeps them: the table, and the rows it was made from."""
    table = Table(
        f"Concurrent runs on one `mlflow server` (PostgreSQL, --workers {WORKERS}): {EPOCHS} epochs x {METRICS} "
        f"metrics each, one log call per epoch; restart: SIGKILLed {KILL_AFTER_S:.0f} s into the logging, up "
        f"{RESTART_AFTER_S:.0f} s later; a run's end waits up to {FINAL_WAIT_S} s for it (BATCHLAB_TRACKING_WAIT_S)",
        ["runs", "server", "points sent", "points stored", "kept for replay", "runs FINISHED", "log call p50 ms",
         "p95 ms", "p99 ms", "load before"],
    )  # fmt: skip
    for row in rows:
        n = row["n"]
        table.add(n, "restarted" if row["restart"] else "up", row["sent"], row["stored"], row["kept_unrecorded"],
                  f"{row['finished']}/{n}", f"{row['p50_ms']:.0f}", f"{row['p95_ms']:.0f}", f"{row['p99_ms']:.0f}",
                  f"{row['load_before']:.1f}")  # fmt: skip
    return {"tables": [table.as_dict()], "rows": rows}


def main() -> dict[str, Any]:
    rows = []
    for restart in (False, True):
        for n in SIZES:
            progress(f"team load: {n} runs{', server restarted' if restart else ''}")
            row = {"load_before": os.getloadavg()[0], **_one(n, restart)}
            progress(f"  {json.dumps({k: v for k, v in row.items() if k != 'failed'})}")  # kept if a later row fails
            for name, error, _ in row["failed"]:
                progress(f"  {name} failed: {error}")
            rows.append(row)
    result = tabulate(rows)
    print(markdown(result["tables"]))
    return result


if __name__ == "__main__":
    main()
