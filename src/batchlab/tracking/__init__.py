"""Experiment tracking at the edges: the only package that imports mlflow.

    base            Tracker (records nothing), Resumable, tag names
    backend         where the store is, whether it answers, a SQLite store ready for concurrent writers
    mlflow_tracker  MlflowTracker: params, epochs, artifacts, models, registry, outage-proof writes
    flavors         mlflow.pytorch without Lightning; model logging without MLflow's scan of every installed package
    lifecycle       run() / attach(): open, continue, end a run; end runs dead processes left RUNNING
    provenance      git, DVC data hash and host tags
    ownership       which process of which host owns a run
    outage          what happens while the backend is away
    pyfunc          the `predictor` pyfunc model (onnx_predictor.py, logged as code): logged, fetched for predict
    digests         sha256 of every file of a run's models, recorded by export, checked by `batchlab verify`
    children        a parent's child runs by key: a finished one's stored result, attempts a rerun replaces
    record          a run's tags, params, metrics and torch weights, read back for `batchlab reproduce`
    registry        a predictor's new version and the champion alias, safe with many exports at once

`fit` and the stages receive a Tracker and never test a flag.
"""

from batchlab.tracking.backend import TrackingUnavailable, check_reachable, prepare_backend, quiet_mlflow, resolve_uri
from batchlab.tracking.base import CHAMPION, NOTE, Resumable, Tracker
from batchlab.tracking.lifecycle import Interrupted, attach, run
from batchlab.tracking.provenance import environment_tags, origin

__all__ = [
    "CHAMPION",
    "NOTE",
    "Interrupted",
    "Resumable",
    "Tracker",
    "TrackingUnavailable",
    "attach",
    "check_reachable",
    "environment_tags",
    "origin",
    "prepare_backend",
    "quiet_mlflow",
    "resolve_uri",
    "run",
]
