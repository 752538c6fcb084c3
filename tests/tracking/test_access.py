"""A team's servers with access control, each with the tool's own mechanism, all on 127.0.0.1:
`mlflow server --app-name basic-auth`, `prefect server` with PREFECT_SERVER_API_AUTH_STRING, and a
`dask scheduler` + `dask worker` with TLS (certificates made by docs/scaling-out.md's openssl lines).

Each server refuses a client without its credentials; `python flows/pipeline.py` and a Dask sweep
with them run end to end; wrong or missing credentials are one line naming the variable, exit
non-zero and change nothing; and no secret is in any store, log, output or file afterwards."""

from __future__ import annotations

import base64
import configparser
import contextlib
import datetime
import os
import re
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from batchlab.config import ConfigError, parse_config
from tests.support import BIN, REPO, TINY, copy_repo, env_with_venv, free_port, merge, prefect_server, wait_until

DOC = REPO / "docs" / "scaling-out.md"
SECTION = "## A team's servers, with access control"
TLS_VARS = (
    "DASK_DISTRIBUTED__COMM__TLS__CA_FILE",
    "DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT",
    "DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY",
)
SWEEP = {"batch_sizes": [16, 32], "seeds": [0], "executor": "dask"}
TRACK = {"enabled": True, "experiment": "access", "registered_model": "access-mlp"}


def _secret(what: str) -> str:
    return f"{what}-{secrets.token_urlsafe(12)}"


# random per session: a match can only be a leak
ADMIN_PW, ALICE_PW, PREFECT_PW, FLASK_KEY = (_secret(w) for w in ("admin", "alice", "prefect", "flask"))
WRONG_PW, WRONG_PREFECT = _secret("wrong"), _secret("wrong-prefect")
PREFECT_AUTH = f"admin:{PREFECT_PW}"


def _doc_section() -> str:
    text = DOC.read_text()
    return text[text.index(SECTION) :]


def _doc_block(lang: str) -> str:
    return re.findall(rf"```{lang}\n(.*?)```", _doc_section(), flags=re.S)[0]


def _stranger_certificate(folder: Path) -> tuple[Path, Path]:
    """A certificate and key signed by a CA of the stranger's own, made with `cryptography`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "stranger-ca")])
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "client")])  # the name the real clients have
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(ca_key, hashes.SHA256())
    )
    folder.mkdir(parents=True)
    (folder / "client.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pkcs8, plain = serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    (folder / "client.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, pkcs8, plain))
    return folder / "client.pem", folder / "client.key"


@dataclass
class Servers:
    folder: Path  # everything the servers, the pipeline and the sweep wrote: searched for secrets
    mlflow: str
    prefect: str
    dask: str
    tls: Path
    stranger: tuple[Path, Path]
    env: dict[str, str]  # a client with every credential
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> Path:
        log = self.folder / "logs" / f"{name}.log"
        with open(log, "w") as out:
            self.procs[name] = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return log

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def _without(env: dict[str, str], *names: str, **changes: str) -> dict[str, str]:
    return {**{k: v for k, v in env.items() if k not in names}, **changes}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl: the certificates are made with docs/scaling-out.md's openssl lines")
    tmp = tmp_path_factory.mktemp("access")
    (tmp / "logs").mkdir()
    tls = tmp / "tls"
    tls.mkdir()
    for line in re.findall(r"^openssl .*$", _doc_section(), flags=re.M):  # the docs' certificates
        subprocess.run(["bash", "-c", line], cwd=tls, check=True, capture_output=True)
    stranger = _stranger_certificate(tmp / "stranger")

    # MLflow: the docs' auth.ini, its database in this folder; the admin's password in the environment
    ini = configparser.ConfigParser()
    ini.read_string(_doc_block("ini"))
    ini["mlflow"]["database_uri"] = f"sqlite:///{tmp / 'mlflow-server' / 'basic_auth.db'}"
    (tmp / "mlflow-server").mkdir()
    with open(tmp / "mlflow-server" / "auth.ini", "w") as f:
        ini.write(f)
    port = free_port()
    mlflow_uri = f"http://127.0.0.1:{port}"
    store = f"sqlite:///{tmp / 'mlflow-server' / 'mlflow.db'}"
    mlflow_cmd = [str(BIN / "mlflow"), "server", "--app-name", "basic-auth", "--host", "127.0.0.1", "--port", str(port),
                  "--workers", "1", "--backend-store-uri", store,
                  "--artifacts-destination", str(tmp / "mlflow-server" / "artifacts")]  # fmt: skip
    mlflow_env = env_with_venv(
        MLFLOW_AUTH_CONFIG_PATH=str(tmp / "mlflow-server" / "auth.ini"),
        MLFLOW_AUTH_ADMIN_PASSWORD=ADMIN_PW,
        MLFLOW_FLASK_SERVER_SECRET_KEY=FLASK_KEY,
    )
    dask_port = free_port()
    dask = f"tls://127.0.0.1:{dask_port}"
    certs = lambda role: ["--tls-ca-file", str(tls / "ca.pem"), "--tls-cert", str(tls / f"{role}.pem"),  # noqa: E731
                          "--tls-key", str(tls / f"{role}.key")]  # fmt: skip
    running = Servers(tmp, mlflow_uri, "", dask, tls, stranger, {})
    try:
        mlflow_log = running.start("mlflow-server", mlflow_cmd, mlflow_env)
        scheduler = [str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(dask_port),
                     "--protocol", "tls", "--no-dashboard", *certs("scheduler")]  # fmt: skip
        scheduler_log = running.start("scheduler", scheduler, env_with_venv())
        with contextlib.ExitStack() as stack:
            with pytest.MonkeyPatch.context() as patch:  # prefect_server passes this process's environment on
                patch.setenv("PREFECT_SERVER_API_AUTH_STRING", PREFECT_AUTH)
                running.prefect = stack.enter_context(prefect_server(tmp))
            wait_until(
                lambda: requests.get(f"{mlflow_uri}/health", timeout=2).ok,
                "the MLflow server",
                process=running.procs["mlflow-server"],
                log=mlflow_log,
            )
            wait_until(lambda: "Scheduler at:" in scheduler_log.read_text(), "the scheduler", log=scheduler_log)
            with pytest.MonkeyPatch.context() as patch:  # the docs' way, as admin
                patch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
                patch.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN_PW)
                from mlflow.server import get_app_client

                get_app_client("basic-auth", tracking_uri=mlflow_uri).create_user("alice", ALICE_PW)
            running.env = env_with_venv(
                MLFLOW_TRACKING_URI=mlflow_uri,
                MLFLOW_TRACKING_USERNAME="alice",
                MLFLOW_TRACKING_PASSWORD=ALICE_PW,
                PREFECT_API_URL=running.prefect,
                PREFECT_API_AUTH_STRING=PREFECT_AUTH,
                **dict(zip(TLS_VARS, (str(tls / f) for f in ("ca.pem", "client.pem", "client.key")), strict=True)),
            )
            # the worker: MLflow's variables (it writes the child runs); not Prefect's auth string, which
            # Prefect's settings bring along with each task
            worker_env = _without(
                running.env, "PREFECT_API_AUTH_STRING", *TLS_VARS, DASK_DISTRIBUTED__WORKER__DAEMON="False"
            )
            worker = [str(BIN / "dask"), "worker", dask, "--name", "w1", "--nthreads", "1", "--no-dashboard",
                      *certs("worker")]  # fmt: skip
            worker_log = running.start("w1", worker, worker_env)
            wait_until(lambda: "Registered to:" in worker_log.read_text(), "the worker", log=worker_log)
            yield running
    finally:
        running.stop()


def _batchlab(
    servers: Servers, name: str, cwd: Path, env: dict[str, str], *args: str
) -> subprocess.CompletedProcess[str]:
    """A command of the CLI, its stdout and stderr kept under the searched folder."""
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    (servers.folder / "logs" / f"{name}.stdout").write_text(proc.stdout)
    (servers.folder / "logs" / f"{name}.stderr").write_text(proc.stderr)
    return proc


@pytest.fixture(scope="module")
def project(servers: Servers) -> Path:
    """A copy of the repo that ran `python flows/pipeline.py` on the servers, with alice's credentials."""
    repo = copy_repo(servers.folder / "repo")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    sweep = {**SWEEP, "dask_address": servers.dask}
    (repo / "params.yaml").write_text(
        yaml.safe_dump(merge(params, {"tracking": TRACK, "sweep": sweep}), sort_keys=False)
    )
    subprocess.run(["git", "commit", "-qam", "the servers"], cwd=repo, env=env_with_venv(), check=True)
    proc = _batchlab(servers, "pipeline", repo, servers.env, str(BIN / "python"), "flows/pipeline.py")
    assert proc.returncode == 0, proc.stderr[-5000:]
    return repo


@pytest.fixture(scope="module")
def swept(servers: Servers, project: Path) -> subprocess.CompletedProcess[str]:
    return _batchlab(servers, "sweep", project, servers.env, "batchlab", "sweep")


def _mlflow(servers: Servers, monkeypatch: pytest.MonkeyPatch) -> Any:
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ALICE_PW)
    return MlflowClient(servers.mlflow)


def _flow_runs(servers: Servers, flow: str) -> list[dict[str, Any]]:
    filters = {"flows": {"name": {"any_": [flow]}}}
    response = requests.post(
        f"{servers.prefect}/flow_runs/filter", json=filters, auth=("admin", PREFECT_PW), timeout=10
    )
    response.raise_for_status()
    return list(response.json())


def test_a_tracking_uri_with_a_login_in_it_is_refused_without_showing_it() -> None:
    from batchlab.tracking.backend import check_reachable

    with pytest.raises(ConfigError) as refused:
        check_reachable(f"http://alice:{ALICE_PW}@127.0.0.1:9")
    assert ALICE_PW not in str(refused.value) and "http://***@127.0.0.1:9" in str(refused.value)
    assert "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD" in str(refused.value)


def test_a_tls_address_without_dask_tls_config_is_one_line_naming_the_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from batchlab.sweep import preflight

    for name in ("PREFECT_API_URL", *TLS_VARS):
        monkeypatch.delenv(name, raising=False)
    cfg = parse_config(merge(TINY, {"sweep": {**SWEEP, "dask_address": "tls://127.0.0.1:9"}}))
    with pytest.raises(preflight.DaskUnavailable) as refused:
        preflight.preflight(cfg)
    assert str(refused.value).startswith("the Dask scheduler at tls://127.0.0.1:9 takes TLS clients only")
    assert all(name in str(refused.value) for name in TLS_VARS)


@pytest.mark.e2e
def test_each_server_refuses_a_client_without_its_credentials(servers: Servers) -> None:
    from distributed import Client
    from distributed.security import Security

    search = f"{servers.mlflow}/api/2.0/mlflow/experiments/search"
    assert requests.get(f"{servers.mlflow}/health", timeout=10).status_code == 200  # open, by MLflow's design
    assert requests.get(search, params={"max_results": 1}, timeout=10).status_code == 401
    assert requests.get(search, params={"max_results": 1}, auth=("alice", WRONG_PW), timeout=10).status_code == 401
    assert requests.get(search, params={"max_results": 1}, auth=("alice", ALICE_PW), timeout=10).status_code == 200

    flows = f"{servers.prefect}/flows/filter"
    assert requests.get(f"{servers.prefect}/health", timeout=10).status_code == 200
    assert requests.post(flows, json={}, timeout=10).status_code == 401
    assert requests.post(flows, json={}, auth=("admin", WRONG_PREFECT), timeout=10).status_code == 401
    assert requests.post(flows, json={}, auth=("admin", PREFECT_PW), timeout=10).status_code == 200

    plain = servers.dask.replace("tls://", "tcp://")
    ca = str(servers.tls / "ca.pem")
    stranger = Security(tls_ca_file=ca, tls_client_cert=str(servers.stranger[0]),
                        tls_client_key=str(servers.stranger[1]), require_encryption=True)  # fmt: skip
    member = Security(tls_ca_file=ca, tls_client_cert=str(servers.tls / "client.pem"),
                      tls_client_key=str(servers.tls / "client.key"), require_encryption=True)  # fmt: skip
    for address, security in ((plain, None), (servers.dask, stranger)):
        with pytest.raises((OSError, TimeoutError)):
            Client(address, security=security, timeout=5, set_as_default=False)
    with Client(servers.dask, security=member, timeout=30, set_as_default=False) as client:
        assert client.submit(sum, [1, 2]).result(timeout=60) == 3


@pytest.mark.e2e
def test_the_pipeline_flow_and_the_dask_sweep_run_with_the_credentials(
    servers: Servers, project: Path, swept: subprocess.CompletedProcess[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert swept.returncode == 0, swept.stderr[-5000:]
    client = _mlflow(servers, monkeypatch)
    experiment = client.get_experiment_by_name("access")
    runs = client.search_runs([experiment.experiment_id])
    pipeline = [r for r in runs if "prefect.flow_run_id" in r.data.tags]
    assert len(pipeline) == 1 and pipeline[0].info.status == "FINISHED"
    assert client.get_latest_versions("access-mlp")  # registered as alice
    parent = [r for r in runs if r.data.tags.get("sweep") == "parent"]
    assert len(parent) == 1 and parent[0].info.status == "FINISHED"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent[0].info.run_id]
    assert sorted(int(r.data.params["train.batch_size"]) for r in children) == [16, 32]
    assert {r.info.status for r in children} == {"FINISHED"}
    assert (project / "reports" / "sweep" / "summary.csv").is_file()
    assert [r["state_type"] for r in _flow_runs(servers, "batchlab-pipeline")] == ["COMPLETED"]
    # the Dask sweep's phases, a flow run each: its clock, its experiments, their truth
    phases = {r["name"]: r["state_type"] for r in _flow_runs(servers, "batchlab-sweep-dask")}
    assert phases == {"sweep-clock": "COMPLETED", "sweep-experiments": "COMPLETED", "sweep-truth": "COMPLETED"}
    assert "Finished in state Completed" in (servers.folder / "logs" / "w1.log").read_text()


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.e2e
def test_wrong_credentials_are_one_line_naming_the_variable_and_change_nothing(
    servers: Servers, project: Path, swept: subprocess.CompletedProcess[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert swept.returncode == 0, swept.stderr[-5000:]
    client = _mlflow(servers, monkeypatch)
    experiment_id = client.get_experiment_by_name("access").experiment_id
    runs_before = {r.info.run_id: r.info.status for r in client.search_runs([experiment_id])}
    files_before = _files(project)
    env = servers.env
    login = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
    cases = {
        "sweep, no MLflow login": (_without(env, *login), "requires a login", "MLFLOW_TRACKING_USERNAME"),
        "sweep, wrong MLflow password": (
            {**env, "MLFLOW_TRACKING_PASSWORD": WRONG_PW},
            "refused the login of user 'alice'",
            "MLFLOW_TRACKING_PASSWORD",
        ),
        "train, wrong MLflow password": (
            {**env, "MLFLOW_TRACKING_PASSWORD": WRONG_PW},
            "refused the login of user 'alice'",
            "MLFLOW_TRACKING_PASSWORD",
        ),
        "sweep, no Prefect auth string": (
            _without(env, "PREFECT_API_AUTH_STRING"),
            "requires",
            "PREFECT_API_AUTH_STRING",
        ),
        "sweep, wrong Prefect auth string": (
            {**env, "PREFECT_API_AUTH_STRING": f"admin:{WRONG_PREFECT}"},
            "refused PREFECT_API_AUTH_STRING",
            "PREFECT_API_AUTH_STRING",
        ),
        "sweep, no Dask certificate": (_without(env, *TLS_VARS), "has no certificate", TLS_VARS[0]),
        "sweep, a stranger's Dask certificate": (
            {**env, TLS_VARS[1]: str(servers.stranger[0]), TLS_VARS[2]: str(servers.stranger[1])},
            "closed in its handshake",
            TLS_VARS[1],
        ),
    }

    def refused(name: str) -> subprocess.CompletedProcess[str]:
        command = "train" if name.startswith("train") else "sweep"
        log_name = re.sub(r"[^a-z]+", "-", name.lower())
        return _batchlab(servers, log_name, project, cases[name][0], "batchlab", command)

    with ThreadPoolExecutor(max_workers=4) as pool:  # each a CLI start, mostly imports: side by side
        procs = dict(zip(cases, pool.map(refused, cases), strict=True))
    for name, (_, says, variable) in cases.items():
        proc = procs[name]
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode != 0 and len(lines) == 1, (name, proc.returncode, proc.stderr[-3000:])
        assert lines[0].startswith("batchlab: error: ") and says in lines[0] and variable in lines[0], (name, lines)
    assert _files(project) == files_before
    assert {r.info.run_id: r.info.status for r in client.search_runs([experiment_id])} == runs_before


def _git_history(repo: Path) -> bytes:
    return subprocess.run(["git", "log", "-p", "--all"], cwd=repo, capture_output=True, check=True).stdout


@pytest.mark.e2e
def test_no_secret_is_in_the_stores_the_logs_the_outputs_or_git(
    servers: Servers, project: Path, swept: subprocess.CompletedProcess[str]
) -> None:
    """After the pipeline, the sweep and the refused commands: every file the servers, the workers and
    the commands wrote (MLflow's and Prefect's databases, the artifacts, every log and output, the
    project's params.yaml, dvc.lock, reports/, sweep/, mlruns/) and the project's Git history."""
    assert swept.returncode == 0, swept.stderr[-5000:]
    plain = [ADMIN_PW, ALICE_PW, PREFECT_PW, FLASK_KEY, WRONG_PW, WRONG_PREFECT]
    encoded = [base64.b64encode(s.encode()).decode() for s in (f"alice:{ALICE_PW}", PREFECT_AUTH, f"admin:{ADMIN_PW}")]
    files = {**_files(servers.folder), "git log -p --all": _git_history(project)}
    assert (servers.folder / "mlflow-server" / "mlflow.db").is_file() and any("prefect.db" in f for f in files)
    assert len(files) > 100, sorted(files)
    users = files["mlflow-server/basic_auth.db"]  # readable as bytes: a name is found, a password only as its hash
    assert b"alice" in users and ALICE_PW.encode() not in users
    leaks = [(name, s) for name, data in files.items() for s in plain + encoded if s.encode() in data]
    assert not leaks, leaks
