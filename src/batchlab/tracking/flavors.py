"""MLflow's model flavors without the work batchlab never needs: what that work cost here, and how it is skipped.

Both shims touch one MLflow import or private cache, for the duration of a call, and leave MLflow as
it was; tests/test_tracking.py fails if a new MLflow moves what they touch.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import ModuleType


def torch_flavor() -> ModuleType:
    """mlflow.pytorch without its Lightning callback: importing mlflow.pytorch imports Lightning
    whenever it is installed (3.9 s here) for a checkpoint callback batchlab never uses. A process
    that already imported Lightning keeps MLflow's behaviour; autolog imports it on demand as before."""
    blocked = "mlflow.pytorch._lightning_autolog"
    lightning = {"lightning", "pytorch_lightning"} & sys.modules.keys()
    if "mlflow.pytorch" in sys.modules or lightning or blocked in sys.modules:
        import mlflow.pytorch

        return mlflow.pytorch
    sys.modules[blocked] = None  # type: ignore[assignment]  # its import raises ImportError, which mlflow.pytorch expects
    try:
        import mlflow.pytorch
    finally:
        del sys.modules[blocked]
    return mlflow.pytorch


@contextlib.contextmanager
def named_requirements() -> Iterator[None]:
    """Log models whose pip requirements are all given by name (batchlab always gives them) without
    MLflow's map of every installed distribution's modules.

    Before writing a model MLflow warns when the environment does not satisfy its requirements. For
    that it maps every installed distribution to its top-level modules
    (importlib_metadata.packages_distributions: 0.86 s per process here, twice per pipeline run) and
    then reads each version with importlib_metadata.version(name), using the map only when a name is
    not a distribution. For named requirements the map adds nothing, so the check runs on an empty one:
    the same versions compared, the same warning on a mismatch. A map another call already built is
    kept; one this call would have built is left for the next caller to build."""
    from mlflow.utils import requirements_utils as reqs

    if getattr(reqs, "_MODULES_TO_PACKAGES", None) is not None:
        yield
        return
    reqs._MODULES_TO_PACKAGES = {}  # type: ignore[assignment]  # MLflow annotates the unset cache only
    try:
        yield
    finally:
        reqs._MODULES_TO_PACKAGES = None
        reqs._PACKAGES_TO_MODULES = None


@contextlib.contextmanager
def logging_into(run_id: str) -> Iterator[None]:
    """While logging a model: model-logging APIs log into the active run, so ours is active (not
    ended afterwards), and its named requirements are checked without MLflow's module map."""
    import mlflow

    active = mlflow.active_run()
    with named_requirements():
        if active is not None and active.info.run_id == run_id:
            yield
            return
        with mlflow.start_run(run_id=run_id):
            yield
