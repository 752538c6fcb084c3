"""`batchlab predict` and the `predictor` pyfunc: raw rows of a real pipeline run in, the classes
evaluate found and one probability per class out, through onnxruntime only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pandas as pd
import pytest
from sklearn.model_selection import train_test_split

from batchlab import data
from batchlab.config import Config, load_config
from tests.support import TINY, env_with_venv, free_port, merge, run, wait_until, write_params
from tests.support.imports import IMPORTS

pytestmark = pytest.mark.integration  # every test runs the CLI on one built pipeline


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """generate -> train -> evaluate -> export through the CLI, tracked in a SQLite store, plus the raw
    (unscaled) test split as CSV with an extra `id` column."""
    root = tmp_path_factory.mktemp("pipeline")
    tracked = {"tracking": {"enabled": True, "tracking_uri": f"sqlite:///{root / 'mlflow.db'}"}}
    write_params(root, merge(TINY, tracked))
    for stage in ("generate", "train", "evaluate", "export"):
        run(["batchlab", stage], root)
    raw_test(load_config(root / "params.yaml")).to_csv(root / "raw_test.csv", index=False)
    run(["batchlab", "predict", "--model", "models/model.onnx", "--input", "raw_test.csv", "--output", REFERENCE], root)
    return root


REFERENCE = "reference.csv"  # the raw test split's predictions, from the ONNX file


def raw_test(cfg: Config) -> pd.DataFrame:
    """The test split before scaling: data.build's split of the same rows."""
    raw = data.raw_table(cfg.data)
    x, y, features = raw.x, raw.y, raw.feature_names
    split = cfg.data
    _, x_test = train_test_split(x, test_size=split.test_fraction, stratify=y, random_state=split.seed)
    frame = pd.DataFrame(x_test, columns=features)
    frame.insert(0, "id", [f"row{i}" for i in range(len(frame))])
    return frame


def _predict(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run(["batchlab", "predict", *args], root, check=check)


def test_predictions_on_the_raw_test_split_equal_evaluates_and_pass_extra_columns_through(pipeline: Path) -> None:
    out = pd.read_csv(pipeline / REFERENCE, dtype={"predicted": str})
    expected = pd.read_csv(pipeline / "reports/predictions.csv", dtype=str)
    assert list(out.columns) == ["id", "predicted", "proba_0", "proba_1"]
    assert out["predicted"].tolist() == expected["predicted"].tolist()
    assert out["id"].tolist() == pd.read_csv(pipeline / "raw_test.csv")["id"].tolist()
    # nothing scaled twice: the probabilities are the softmax of the ONNX graph's logits on the raw rows (it scales)
    session = ort.InferenceSession(str(pipeline / "models/model.onnx"), providers=["CPUExecutionProvider"])
    raw = pd.read_csv(pipeline / "raw_test.csv", float_precision="round_trip").drop(columns="id").to_numpy(np.float64)
    logits = session.run(None, {"features": raw})[0].astype(np.float64)
    softmax = np.exp(logits - logits.max(1, keepdims=True))
    softmax /= softmax.sum(1, keepdims=True)
    np.testing.assert_array_equal(out[["proba_0", "proba_1"]].to_numpy(), softmax)


def test_predict_imports_no_torch_and_streams_parquet_and_npy_in_chunks_to_the_same_answer(pipeline: Path) -> None:
    frame = pd.read_csv(pipeline / "raw_test.csv", float_precision="round_trip")
    frame.to_parquet(pipeline / "raw_test.parquet")
    np.save(pipeline / "raw_test.npy", frame.drop(columns="id").to_numpy())
    reference = pipeline / REFERENCE
    argv = ["predict", "--model", "models/model.onnx", "--input", "raw_test.parquet", "--output", "pq.csv"]
    proc = subprocess.run(
        [sys.executable, "-c", IMPORTS, "torch,mlflow", *argv, "--chunk-rows", "7"],
        cwd=pipeline, env=env_with_venv(), capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "imported: ", proc.stdout
    assert (pipeline / "pq.csv").read_text() == reference.read_text()
    shown = _predict(pipeline, "--model", "models/model.onnx", "--input", "raw_test.npy", "--chunk-rows", "7").stdout
    assert shown.splitlines() == [line.split(",", 1)[1] for line in reference.read_text().splitlines()]


def test_mlflow_uris_name_the_same_model(pipeline: Path) -> None:
    run_id = json.loads((pipeline / "reports/train.json").read_text())["run_id"]
    expected = (pipeline / REFERENCE).read_text()
    # the registry's versions are the predictor; the torch model stands for the predictor of its run
    for uri in ("models:/batchlab-mlp@champion", "models:/batchlab-mlp/1", f"runs:/{run_id}/predictor",
                f"runs:/{run_id}/onnx_model", f"runs:/{run_id}/torch_model"):  # fmt: skip
        assert _predict(pipeline, "--model", uri, "--input", "raw_test.csv").stdout == expected, uri


def _bad_input(root: Path, kind: str) -> str:
    """A copy of the raw test split with one thing wrong (at row 40 where a row is wrong); its name."""
    frame = pd.read_csv(root / "raw_test.csv").astype(object)
    name = f"{kind}.csv"
    if kind == "nan":
        frame.loc[39, "x3"] = float("nan")
    elif kind == "inf":
        frame.loc[39, "x0"] = "inf"
    elif kind == "text":
        frame.loc[39, "x5"] = "abc"
    elif kind == "columns":
        frame = frame.drop(columns=["x1", "x6"])
    elif kind == "wide":
        np.save(root / "wide.npy", np.zeros((4, 9)))
        return "wide.npy"
    elif kind == "format":
        (root / "rows.txt").write_text("1,2\n")
        return "rows.txt"
    frame.to_csv(root / name, index=False)
    return name


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("nan", "missing, NaN or infinite value in column 'x3' (row 40)"),
        ("inf", "missing, NaN or infinite value in column 'x0' (row 40)"),
        ("text", "feature column 'x5' is not numeric (row 40: 'abc')"),
        ("columns", "missing feature columns ['x1', 'x6']"),
        ("wide", "shape (4, 9), but the model takes (rows, 8)"),
        ("format", "input must be .csv, .parquet or .npy"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_no_output_file(pipeline: Path, kind: str, message: str) -> None:
    name = _bad_input(pipeline, kind)
    # chunks of 16 rows: the bad row 40 is in the third, after two chunks were predicted
    args = ("--model", "models/model.onnx", "--input", name, "--output", "bad.csv", "--chunk-rows", "16")
    proc = _predict(pipeline, *args, check=False)
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"batchlab: error: {name}: {message}"), line
    assert not list(pipeline.glob("*bad.csv*"))  # no output, no temporary left


def test_a_bad_row_after_predicted_chunks_leaves_stdout_empty(pipeline: Path) -> None:
    name = _bad_input(pipeline, "nan")
    # the docs' `batchlab predict ... > predictions.csv`: stdout is the file the shell opened;
    # chunks of 16 rows: the bad row 40 is in the third, after two chunks were predicted
    with (pipeline / "redirected.csv").open("w") as stdout:
        proc = subprocess.run(
            ["batchlab", "predict", "--model", "models/model.onnx", "--input", name, "--chunk-rows", "16"],
            cwd=pipeline, env=env_with_venv(), stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=600,
        )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "missing, NaN or infinite value in column 'x3' (row 40)" in proc.stderr
    assert (pipeline / "redirected.csv").read_text() == ""


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()  # reaped: its pid names no process now (a reuse this soon is rarer still)
    return proc.pid


def test_a_sigkilled_predicts_temporary_goes_at_the_next_run_and_a_running_ones_stays(pipeline: Path) -> None:
    folder = pipeline / "killed"
    folder.mkdir()
    frame = pd.read_csv(pipeline / "raw_test.csv")
    pd.concat([frame] * (20_000 // len(frame) + 1)).to_csv(folder / "many.csv", index=False)
    args = ["batchlab", "predict", "--model", "models/model.onnx", "--output", "killed/out.csv"]
    # one row per chunk: tens of seconds, long enough to write beside it and to kill it mid-run
    slow = subprocess.Popen([*args, "--input", "killed/many.csv", "--chunk-rows", "1"], cwd=pipeline,
                            env=env_with_venv(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        tmp = wait_until(lambda: next(folder.glob(".out.csv.*.tmp"), None), "predict's temporary", process=slow)
        assert tmp.name.startswith(f".out.csv.{slow.pid}."), tmp.name
        host = tmp.name.split(".")[4]
        dead = _dead_pid()
        others = [f".out.csv.{dead}.other-host.abcd1234.tmp", ".out.csv.abcd1234.tmp",  # another host's; no pid
                  f".other.csv.{dead}.{host}.abcd1234.tmp", "notes.txt"]  # another output's; a user's  # fmt: skip
        for other in others:
            (folder / other).write_text("not predict's to remove")
        # a second predict of the same output while the first runs: the running one's temporary stays
        run([*args, "--input", "raw_test.csv"], pipeline)
        assert slow.poll() is None and tmp.exists()
        assert (folder / "out.csv").read_text() == (pipeline / REFERENCE).read_text()
    finally:
        os.kill(slow.pid, signal.SIGKILL)  # what the user did: nothing in the process can clean up
        slow.wait()
    assert tmp.exists()  # left behind, as the user found it
    run([*args, "--input", "raw_test.csv"], pipeline)
    assert sorted(p.name for p in folder.iterdir()) == sorted(["many.csv", "out.csv", *others])
    assert (folder / "out.csv").read_text() == (pipeline / REFERENCE).read_text()


def test_generate_writes_raw_example_rows_that_predict_as_the_test_split_does(pipeline: Path) -> None:
    # the docs' `batchlab predict --input data/prepared/examples.csv`: the first 20 test rows, raw
    _predict(pipeline, "--model", "models/model.onnx", "--input", "data/prepared/examples.csv", "--output", "ex.csv")
    examples = pd.read_csv(pipeline / "data/prepared/examples.csv")
    assert list(examples.columns) == list(raw_test(load_config(pipeline / "params.yaml")).columns[1:])
    np.testing.assert_allclose(
        examples.to_numpy(), raw_test(load_config(pipeline / "params.yaml")).iloc[:20, 1:], rtol=1e-5
    )
    got = pd.read_csv(pipeline / "ex.csv", dtype={"predicted": str})["predicted"].tolist()
    assert got == pd.read_csv(pipeline / "reports/predictions.csv", dtype=str)["predicted"].tolist()[:20]


def test_a_header_only_input_gives_the_header_only(pipeline: Path) -> None:
    (pipeline / "header.csv").write_text((pipeline / "raw_test.csv").read_text().splitlines()[0] + "\n")
    _predict(pipeline, "--model", "models/model.onnx", "--input", "header.csv", "--output", "empty.csv")
    assert (pipeline / "empty.csv").read_text().splitlines() == ["id,predicted,proba_0,proba_1"]


def test_a_model_whose_feature_count_differs_or_that_has_no_scaler_is_refused(pipeline: Path) -> None:
    model = onnx.load(str(pipeline / "models/model.onnx"))
    prep = json.loads(next(p.value for p in model.metadata_props if p.key == "batchlab.preprocessing"))
    prep["feature_names"] = prep["feature_names"][:-1]
    model.metadata_props[0].value = json.dumps(prep)
    onnx.save(model, str(pipeline / "narrow.onnx"))
    del model.metadata_props[:]
    onnx.save(model, str(pipeline / "bare.onnx"))
    proc = _predict(pipeline, "--model", "narrow.onnx", "--input", "raw_test.csv", check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "batchlab: error: narrow.onnx takes 8 features but its record names 7; re-export it"
    )
    proc = _predict(pipeline, "--model", "bare.onnx", "--input", "raw_test.csv", check=False)
    assert proc.returncode == 2 and "bare.onnx holds no batchlab preprocessing" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_pyfunc_predictor_returns_class_and_probabilities_and_mlflow_evaluate_scores_it(
    pipeline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow

    uri = f"sqlite:///{pipeline / 'mlflow.db'}"
    # mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI: undone after the test, or every later
    # test's subprocesses would log into this store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    # what the registry serves under the name and the champion alias takes raw rows, as predict does
    predictor = mlflow.pyfunc.load_model("models:/batchlab-mlp@champion")
    rows = pd.read_csv(pipeline / "raw_test.csv", float_precision="round_trip").drop(columns="id")
    expected = pd.read_csv(pipeline / REFERENCE, dtype={"predicted": str}).drop(columns="id")
    pd.testing.assert_frame_equal(predictor.predict(rows), expected, check_dtype=False)
    version = mlflow.MlflowClient().get_model_version_by_alias("batchlab-mlp", "champion")
    run_id = json.loads((pipeline / "reports/train.json").read_text())["run_id"]
    assert version.description.startswith("Raw feature rows in, class and probabilities out") and (
        f"runs:/{run_id}/torch_model" in version.description
    ), version.description
    # the evaluator takes one column of classes (probabilities only from scikit-learn models)
    labels = pd.read_csv(pipeline / "reports/predictions.csv", dtype=str)["actual"]
    result = mlflow.models.evaluate(
        model=lambda frame: predictor.predict(frame, params={"output": "class"}),
        data=rows.assign(label=labels.to_numpy()),
        targets="label",
        model_type="classifier",
        evaluator_config={"log_model_explainability": False},
    )
    metrics = json.loads((pipeline / "reports/metrics.json").read_text())
    assert result.metrics["accuracy_score"] == pytest.approx(metrics["accuracy"])
    assert result.metrics["f1_score"] == pytest.approx(metrics["f1_1"])


def test_mlflow_models_serve_answers_with_class_and_probabilities(pipeline: Path) -> None:
    import requests

    port = free_port()
    log = pipeline / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            ["mlflow", "models", "serve", "-m", "models:/batchlab-mlp@champion", "--env-manager", "local",
             "-h", "127.0.0.1", "-p", str(port)],
            cwd=pipeline, env=env_with_venv(MLFLOW_TRACKING_URI=f"sqlite:///{pipeline / 'mlflow.db'}"),
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: requests.get(f"{url}/ping", timeout=2).ok, "the model server", process=server, log=log)
        rows = pd.read_csv(pipeline / "raw_test.csv", float_precision="round_trip").drop(columns="id")
        body = {"dataframe_split": json.loads(rows.to_json(orient="split", index=False, double_precision=15))}
        answer = requests.post(f"{url}/invocations", json=body, timeout=30).json()["predictions"]
    finally:
        server.terminate()
        server.wait(timeout=60)
    expected = pd.read_csv(pipeline / REFERENCE, dtype={"predicted": str}).drop(columns="id")
    answered = pd.DataFrame(answer)  # every test row: 0 classes differ from `batchlab predict`
    assert list(answered.columns) == ["predicted", "proba_0", "proba_1"]
    assert answered["predicted"].tolist() == expected["predicted"].tolist()
    np.testing.assert_allclose(answered[["proba_0", "proba_1"]], expected[["proba_0", "proba_1"]], rtol=1e-6)
