"""Registering a predictor version and moving the champion alias, safe with many runs at once.

MLflow creates a version as "read the highest number, insert the next" and retries a clash three
times; 32 exports at once can clash more often, so a clash that gets through is tried again here.

The alias has no compare-and-set: two exports that both read the old champion and both set the
alias leave whichever wrote last, the worse one as often as not. So each export, after its version
exists, settles the alias among the champion and every version still being settled (its own and
its concurrent rivals', tagged `batchlab.settling` until their export is done) or registered since
it began: the best score wins, a tie keeps the champion (then the lower number), and it reads back
and settles again until what it reads is settled. An export's write can be stale (decided on a
read a rival has since overtaken), but every writer reads back after it writes, and each version
that exists then and is not settled is among what it reads, so the alias ends on the best of
them. Counting rivals from the highest number at the start instead let an export that began
while a better rival was still settling leave its own, worse, version champion. Versions settled
before are not reconsidered: a champion moved back by hand stays until a newer version beats it,
as with one export at a time. (A version whose export died mid-settle keeps its tag and is
considered by the next export.)
"""

from __future__ import annotations

import time
from typing import Any

from batchlab.tracking.backend import retry_locked
from batchlab.tracking.base import CHAMPION

SETTLE_ROUNDS = 20
SETTLING = "batchlab.settling"  # on a version while its export settles the alias


def _clashed(err: Exception) -> bool:
    text = str(err)
    return "model_versions" in text and ("duplicate key" in text or "UNIQUE constraint failed" in text)


def _versions(client: Any, name: str) -> list[Any]:
    try:
        return list(retry_locked(client.search_model_versions, f"name='{name}'"))
    except Exception as err:
        if "RESOURCE_DOES_NOT_EXIST" in str(err):
            return []
        raise


def _score(version: Any, metric: str) -> float:
    try:
        return float(version.tags.get(metric, "-inf"))
    except ValueError:
        return float("-inf")


def _champion(client: Any, name: str) -> Any | None:
    import mlflow

    try:
        return retry_locked(client.get_model_version_by_alias, name, CHAMPION)
    except mlflow.exceptions.MlflowException as err:
        if "RESOURCE_DOES_NOT_EXIST" in str(err) or "not found" in str(err).lower():
            return None
        raise


def create_version(client: Any, name: str, model_uri: str, tags: dict[str, str]) -> Any:
    """mlflow.register_model (which creates the registered model when absent, tolerating a rival
    doing the same), tried again while the version number clashes."""
    import mlflow

    for attempt in range(8):
        try:
            return mlflow.register_model(model_uri, name, tags=tags)
        except Exception as err:
            if not _clashed(err) or attempt == 7:
                raise
            time.sleep(0.05 * 2**attempt)
    raise AssertionError("unreachable")


def settle_champion(client: Any, name: str, metric: str, settled: set[int]) -> int | None:
    """Move the alias to the best of the champion and the versions not in `settled` (those settled
    when this export began); the champion's version number once what was read back needed no move."""
    for _ in range(SETTLE_ROUNDS):
        champion = _champion(client, name)
        rivals = [v for v in _versions(client, name) if int(v.version) not in settled]
        held = [] if champion is None else [(_score(champion, metric), 1, -int(champion.version))]
        ranked = held + [(_score(v, metric), 0, -int(v.version)) for v in rivals]
        if not ranked:
            return None
        best = -max(ranked)[2]
        if champion is not None and int(champion.version) == best:
            return best
        retry_locked(client.set_registered_model_alias, name, CHAMPION, str(best))
    return None if champion is None else int(champion.version)


def register(client: Any, name: str, model_uri: str, tags: dict[str, str], metric: str) -> tuple[str, bool]:
    """A new version of `name` from `model_uri`, and whether the champion alias ends on it."""
    settled = {int(v.version) for v in _versions(client, name) if SETTLING not in v.tags}
    version = create_version(client, name, model_uri, {**tags, SETTLING: "true"})
    champion = settle_champion(client, name, metric, settled)
    retry_locked(client.delete_model_version_tag, name, str(version.version), SETTLING)
    return str(version.version), champion == int(version.version)
