"""What the tests share: tiny configs and data, copies of the repo, the commands a user runs, and
real servers (MLflow on PostgreSQL, Prefect) started and stopped for a test. conftest.py holds the
fixtures; tests/support/tiers.py the tiers and their guard."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from batchlab import tracking
from batchlab.config import Config, parse_config

REPO = Path(__file__).resolve().parents[2]


BIN = Path(sys.executable).parent


TINY: dict[str, Any] = {
    "data": {"samples": 600, "features": 8, "informative": 5, "class_sep": 1.5},
    "model": {"hidden_sizes": [16], "dropout": 0.0},
    "train": {"epochs": 4, "batch_size": 32, "lr": 0.01, "threads": 1, "early_stopping_patience": 0},
    "evaluate": {},
    "export": {},
    "tracking": {"enabled": False},
    "sweep": {"batch_sizes": [16, 32, 64], "epochs": 3, "seeds": [0]},
}


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, values in override.items():
        out.setdefault(section, {}).update(values)
    return out


def tiny_config(**override: dict[str, Any]) -> Config:
    return parse_config(merge(TINY, override))


def seeds_apart(cfg: Config, paths: Any) -> str | None:
    """The sweep's one answer to whether its seeds train together (run.prepare's), for a test that
    groups or branches without a whole sweep: why they cannot, or None."""
    from batchlab import data
    from batchlab.seeds.vectorized import sweep_trains_apart

    return sweep_trains_apart(cfg, lambda: data.load(paths.data))


def free_port() -> int:
    """A 127.0.0.1 port nothing listens on right now, for a server a test starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


T = TypeVar("T")


# a loaded 2-core machine starts a server or a rank many times slower than an idle one:
# waits are long, and end early as soon as the thing is ready or its process has died
WAIT_S = 300.0


def wait_until(
    check: Callable[[], T | None],
    what: str,
    *,
    timeout: float = WAIT_S,
    interval: float = 0.2,
    process: subprocess.Popen[Any] | None = None,
    log: Path | None = None,
) -> T:
    """Poll `check` until it returns something truthy, and return it. An exception from `check`
    counts as "not yet". Fails naming `what` (plus the tail of `log`) at the deadline, or at
    once when `process` has exited. The one readiness wait for every test."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            result = check()
            if result:
                return result
        except Exception as err:  # not ready yet: a server still starting, a file half-written
            last_error = err
        exited = process is not None and process.poll() is not None
        if exited or time.monotonic() > deadline:
            why = f"process exited {process.poll()}" if exited and process else f"not within {timeout:.0f} s"
            tail = log.read_text(errors="replace")[-4000:] if log is not None and log.exists() else ""
            raise AssertionError(f"waited for {what}: {why}; last error: {last_error!r}\n{tail}")
        time.sleep(interval)


def prefect_call(api: str, call: Callable[[Any], Any]) -> Any:
    """Await `call(client)` with a Prefect client of the server at `api`."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def go() -> Any:
        async with get_client() as client:
            return await call(client)

    with temporary_settings(updates={PREFECT_API_URL: api}):
        return asyncio.run(go())


def default_sigint() -> None:
    """A child's Ctrl-C as in a terminal: a shell script's background job starts with SIGINT
    ignored, and Python keeps an ignored SIGINT (no KeyboardInterrupt). Popen(preexec_fn=...)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def env_with_venv(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
    env.update(
        GIT_AUTHOR_NAME="batchlab-test",
        GIT_AUTHOR_EMAIL="test@batchlab.invalid",
        GIT_COMMITTER_NAME="batchlab-test",
        GIT_COMMITTER_EMAIL="test@batchlab.invalid",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        **extra,
    )
    return env


def run(cmd: list[str], cwd: Path, check: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, env=env_with_venv(**env), capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def set_params(repo: Path, section: str, **values: object) -> None:
    """Change keys of one section of `repo`/params.yaml, as a user editing it would."""
    path = repo / "params.yaml"
    params = yaml.safe_load(path.read_text())
    params[section].update(values)
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def write_params(folder: Path, cfg: dict[str, Any], name: str = "params.yaml") -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def copy_repo(dest: Path) -> Path:
    """The repo's tracked files at `dest`, in a fresh git + DVC repo, with tiny params: a copy of
    one template per test process (one `git init/add/commit`, not one per test)."""
    shutil.copytree(_template_repo(), dest, symlinks=True)
    refresh_git_index(dest)
    return dest


def refresh_git_index(repo: Path) -> None:
    """Git's index of a copied repo holds the original files' inodes and ctimes, so every file looks
    changed to `git diff-files` (and to the libraries that read the index) until it is refreshed."""
    subprocess.run(["git", "update-index", "-q", "--refresh"], cwd=repo, capture_output=True, check=False)


@functools.cache
def _template_repo() -> Path:
    import atexit
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="batchlab-template-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    dest = root / "repo"
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    real = yaml.safe_load((REPO / "params.yaml").read_text())
    write_params(dest, merge(real, TINY))
    run(["git", "init", "-q"], dest)
    run(["git", "add", "-A"], dest)
    run(["git", "commit", "-qm", "init"], dest)
    return dest


def postgres_available() -> bool:
    try:
        import psycopg2

        psycopg2.connect(host="127.0.0.1", port=5432, user="postgres", dbname="postgres", connect_timeout=3).close()
        return True
    except Exception:
        return False


class MlflowServer:
    """`mlflow server` on a fixed 127.0.0.1 port over one PostgreSQL database: kill it, start it again."""

    def __init__(self, folder: Path, db: str, driver: str = "") -> None:
        self.folder, self.db = folder, db
        # "" is MLflow's documented postgresql:// (SQLAlchemy 2.1 picks psycopg 3); "+psycopg2" the older driver
        self.store = f"postgresql{driver}://postgres@127.0.0.1:5432/{db}"
        self.uri = f"http://127.0.0.1:{free_port()}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        port = self.uri.rsplit(":", 1)[1]
        artifacts = str(self.folder / "artifacts")
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", port, "--workers", "1",
               "--backend-store-uri", self.store, "--artifacts-destination", artifacts]  # fmt: skip
        # without MLflow's GenAI job runners, as `make ui` starts it: 8 processes fewer per server
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with open(self.folder / "server.log", "a") as log:
            # its own process group: `mlflow server` runs uvicorn as a child, and kill() takes both
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True, env=env)
        wait_until(
            lambda: tracking.check_reachable(self.uri, timeout_s=1) is None,
            f"mlflow server {self.uri}",
            interval=0.5,
            process=self.proc,
            log=self.folder / "server.log",
        )

    def kill(self) -> None:
        """The server dies at once, as when its machine goes away."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def _admin() -> Any:
    import psycopg2

    admin = psycopg2.connect(host="127.0.0.1", port=5432, user="postgres", dbname="postgres")
    admin.autocommit = True
    return admin


def _shared_lock(name: str) -> Any:
    """A lock all test processes of this machine share (pytest-xdist workers, and CI beside a session)."""
    import tempfile

    from filelock import FileLock

    return FileLock(str(Path(tempfile.gettempdir()) / f"{name}.lock"))


@functools.cache
def mlflow_template_db() -> str:
    """A PostgreSQL database holding MLflow's migrated, empty schema, made once per MLflow version
    on this machine: each server's database is a copy of it (CREATE DATABASE ... TEMPLATE), not a
    fresh run of MLflow's migrations. Built under another name and renamed, so a build cut short
    is never taken for a template."""
    import mlflow
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    name = "batchlab_mlflow_" + "".join(c if c.isalnum() else "_" for c in mlflow.__version__)
    with _shared_lock(name), contextlib.closing(_admin()) as admin:
        cursor = admin.cursor()
        cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
        if cursor.fetchone() is None:
            building = f"{name}_building"
            cursor.execute(f"DROP DATABASE IF EXISTS {building} WITH (FORCE)")
            cursor.execute(f"CREATE DATABASE {building}")
            import tempfile

            with tempfile.TemporaryDirectory() as artifacts:
                store = SqlAlchemyStore(f"postgresql://postgres@127.0.0.1:5432/{building}", artifacts)
                store.engine.dispose()
            cursor.execute(f"ALTER DATABASE {building} RENAME TO {name}")  # refused while connected: none is
    return name


@contextlib.contextmanager
def mlflow_on_postgres(folder: Path, driver: str = "") -> Iterator[MlflowServer]:
    """A started MlflowServer over a fresh PostgreSQL database (a copy of the migrated template),
    dropped afterwards (skips without PostgreSQL).
    `driver`: "" for the plain postgresql:// URI, "+psycopg2" for postgresql+psycopg2://."""
    if not postgres_available():
        pytest.skip("no PostgreSQL answers at 127.0.0.1:5432 (start it to run the tracking-server tests)")
    import uuid

    db = f"batchlab_test_{uuid.uuid4().hex[:8]}"
    template = mlflow_template_db()
    admin = _admin()
    admin.cursor().execute(f"CREATE DATABASE {db} TEMPLATE {template}")
    running = MlflowServer(folder, db, driver)
    try:
        running.start()
        yield running
    finally:
        running.kill()
        admin.cursor().execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        admin.close()


@functools.cache
def prefect_template_home() -> Path:
    """A PREFECT_HOME whose SQLite database has every Prefect migration applied, made once per test
    process: a server's home starts as a copy of it instead of migrating ~100 steps at start."""
    import atexit
    import tempfile

    home = Path(tempfile.mkdtemp(prefix="batchlab-prefect-home-"))
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    env = env_with_venv(PREFECT_HOME=str(home))
    env.pop("PREFECT_API_URL", None)
    subprocess.run(["prefect", "server", "database", "upgrade", "-y"], env=env, check=True, capture_output=True)
    return home


def prefect_home(dest: Path) -> Path:
    """`dest` as a PREFECT_HOME holding a migrated database."""
    shutil.copytree(prefect_template_home(), dest)
    return dest


@contextlib.contextmanager
def prefect_server(folder: Path) -> Iterator[str]:
    """`prefect server start` on a free 127.0.0.1 port with its own home (SQLite); yields its API URL."""
    import httpx

    port = free_port()
    home = prefect_home(folder / "prefect-home")
    env = env_with_venv(PREFECT_HOME=str(home), PREFECT_UI_ENABLED="false")
    env.pop("PREFECT_API_URL", None)
    log = folder / "prefect-server.log"
    with open(log, "w") as out:
        cmd = ["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
        server = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    api = f"http://127.0.0.1:{port}/api"
    try:
        check = lambda: httpx.get(f"{api}/health", timeout=2).status_code == 200  # noqa: E731
        wait_until(check, "the Prefect server's health check", process=server, log=log)
        yield api
    finally:
        stop_group(server)


def stop_group(proc: subprocess.Popen[Any], grace_s: float = 60.0) -> None:
    """SIGTERM a process started in its own session (its group: a server and its children), then
    SIGKILL what is still there after `grace_s`: a test ends its servers, and a slow shutdown on a
    loaded machine (a Prefect worker took over 60 s at load 6) is no failure of what it tested."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
