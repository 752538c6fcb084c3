"""The store URI MLflow's docs show, `postgresql://…`, works as written: SQLAlchemy 2.1 maps it to
psycopg 3, which the lock ships beside psycopg2 (`postgresql+psycopg2://` keeps working)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.support import mlflow_on_postgres

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("driver", ["", "+psycopg2"], ids=["postgresql", "postgresql+psycopg2"])
def test_mlflow_server_on_either_postgresql_uri_logs_a_run(tmp_path: Path, driver: str) -> None:
    import psycopg2

    with mlflow_on_postgres(tmp_path, driver) as server:  # a real `mlflow server --backend-store-uri <that URI>`
        assert server.store.startswith(f"postgresql{driver}://")
        client = MlflowClient(tracking_uri=server.uri)
        run_id = client.create_run(client.create_experiment("store-uri")).info.run_id
        client.log_param(run_id, "train.lr", "0.004")
        client.log_metric(run_id, "f1_macro", 0.93, step=1)
        client.set_terminated(run_id)

        # read where the server wrote it, in PostgreSQL, not back through the server
        with psycopg2.connect(host="127.0.0.1", port=5432, user="postgres", dbname=server.db) as conn:
            cursor = conn.cursor()
            cursor.execute("SELECT key, value FROM metrics WHERE run_uuid = %s", (run_id,))
            assert cursor.fetchall() == [("f1_macro", 0.93)]
            cursor.execute("SELECT status FROM runs WHERE run_uuid = %s", (run_id,))
            assert cursor.fetchall() == [("FINISHED",)]
        conn.close()
