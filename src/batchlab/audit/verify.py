"""`batchlab verify`: re-hash what DVC and MLflow recorded and name every file that no longer matches.

DVC never re-reads its cache: `dvc status` trusts the hashes it saw before (keyed by mtime and size),
and `dvc checkout` copies whatever a cache file holds. This reads every byte again: each output in
the workspace and each cache entry against dvc.lock (and *.dvc files), and the current MLflow run's
models against the digests export recorded (tracking/digests.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class IntegrityError(RuntimeError):
    """Files that differ from their recorded hashes; the lines printed before name them."""


@dataclass
class Report:
    files: int = 0  # files hashed
    outputs: int = 0  # DVC outputs checked
    models: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        models = f", {len(self.models)} MLflow models" if self.models else ""
        head = f"verify: {self.files} files of {self.outputs} DVC outputs{models} re-hashed; "
        head += f"{len(self.mismatches)} mismatches" if self.mismatches else "all match"
        return [head, *(f"mismatch: {m}" for m in self.mismatches), *(f"note: {n}" for n in self.notes)]


def md5(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "md5").hexdigest()


def dir_hash(entries: dict[str, str]) -> str:
    """DVC 3's hash of a directory: md5 of its sorted JSON listing, plus `.dir`."""
    listing = [{"md5": m, "relpath": r} for r, m in sorted(entries.items())]  # by the relpath string, as DVC
    return hashlib.md5(json.dumps(listing, sort_keys=True).encode()).hexdigest() + ".dir"


class _Checker:
    def __init__(self, repo: Any, root: Path, report: Report) -> None:
        self.repo, self.root, self.report = repo, root, report
        self.cache = repo.cache.local

    def rel(self, path: str | Path) -> str:
        path = Path(path)
        return path.relative_to(self.root).as_posix() if path.is_relative_to(self.root) else str(path)

    def hash(self, path: Path) -> str:
        self.report.files += 1
        return md5(path)

    def cache_entry(self, name: str, oid: str) -> Path | None:
        """The cache file of `oid` if it holds it (a mismatch named otherwise); None when missing."""
        path = Path(self.cache.oid_to_path(oid))
        if not path.is_file():
            self.report.mismatches.append(f"{name}: its cache entry {self.rel(path)} is missing (`dvc commit` or "
                                          "`dvc pull` brings it back)")
            return None
        content = self.hash(path)
        if content != oid.removesuffix(".dir"):
            self.report.mismatches.append(f"{name}: cache entry {self.rel(path)} holds md5 {content}, "
                                          f"not {oid.removesuffix('.dir')}")
            return None
        return path

    def check_cache(self, present: bool, oid: str) -> bool:
        """Whether to check the cache entry of an output: one neither here nor in the cache was never made here."""
        return present or Path(self.cache.oid_to_path(oid)).is_file()

    def not_here(self, name: str, made_here: bool) -> None:
        """An output missing from the workspace: deleted when the cache holds it (it was made here), a
        note when neither has it (a fresh clone before `dvc pull`, a stage never run)."""
        if made_here:
            self.report.mismatches.append(f"{name} is missing from the workspace (`dvc checkout {name}` restores it)")
        else:
            self.report.notes.append(f"{name} is not in the workspace (`dvc checkout` or `dvc repro` makes it)")

    def file(self, path: Path, expected: str, cached: bool) -> None:
        name, present = self.rel(path), path.is_file()
        in_cache = cached and self.check_cache(present, expected)
        if not present:
            self.not_here(name, in_cache)
        elif (got := self.hash(path)) != expected:
            self.report.mismatches.append(f"{name}: md5 {got}, dvc.lock says {expected}")
        if in_cache:
            self.cache_entry(name, expected)

    def directory(self, path: Path, expected: str, cached: bool) -> None:
        name, present = self.rel(path), path.is_dir()
        listing: dict[str, str] | None = None
        in_cache = cached and self.check_cache(present, expected)
        if in_cache and (manifest := self.cache_entry(name, expected)):
            listing = {e["relpath"]: e["md5"] for e in json.loads(manifest.read_bytes())}
        if not present:
            self.not_here(name, in_cache)
        else:
            ignored = self.repo.dvcignore.is_ignored_file
            files = [p for p in sorted(path.rglob("*")) if p.is_file() and not ignored(str(p))]
            here = {p.relative_to(path).as_posix(): self.hash(p) for p in files}
            if dir_hash(here) != expected:
                self._name_differences(name, here, listing, expected)
        for relpath, oid in (listing or {}).items():
            self.cache_entry(f"{name}/{relpath}", oid)

    def _name_differences(self, name: str, here: dict[str, str], listing: dict[str, str] | None, expected: str) -> None:
        if listing is None or listing == here:  # no listing to compare with: the directory as a whole
            self.report.mismatches.append(f"{name}: directory hash {dir_hash(here)}, dvc.lock says {expected}")
            return
        for relpath in sorted(here.keys() | listing.keys()):
            if relpath not in here:
                self.report.mismatches.append(f"{name}/{relpath}: missing")
            elif relpath not in listing:
                self.report.mismatches.append(f"{name}/{relpath}: not in dvc.lock's listing of {name}")
            elif here[relpath] != listing[relpath]:
                self.report.mismatches.append(
                    f"{name}/{relpath}: md5 {here[relpath]}, dvc.lock says {listing[relpath]}"
                )


def check_dvc(root: Path, report: Report) -> None:
    """Every output dvc.lock and the *.dvc files record, in the workspace and in the local cache."""
    from dvc.repo import Repo

    repo = Repo(str(root))
    try:
        checker = _Checker(repo, root.resolve(), report)
        for out in repo.index.outs:
            path, oid = Path(out.fs_path), out.hash_info.value
            if not oid:
                report.notes.append(f"{checker.rel(path)} has no hash in dvc.lock yet (`dvc repro` records it)")
                continue
            if out.hash_name != "md5":  # DVC 2's md5-dos2unix: hashed differently; `dvc status` still covers it
                report.notes.append(f"{checker.rel(path)}: {out.hash_name} hash (DVC 2) not re-hashed")
                continue
            report.outputs += 1
            (checker.directory if oid.endswith(".dir") else checker.file)(path, oid, out.use_cache)
    finally:
        repo.close()


def check_mlflow(run_id: str, tracking_uri: str, report: Report) -> None:
    from batchlab.tracking import digests

    result = digests.check(run_id, tracking_uri)
    report.models += result.checked
    report.mismatches += result.mismatches
    report.notes += [f"{label} has no recorded digests (`batchlab export` records them)" for label in result.unrecorded]


def verify(root: Path, run_id: str | None, tracking_uri: str | None) -> Report:
    """Check DVC's outputs and cache, then (with a run and a store) the run's MLflow models."""
    report = Report()
    check_dvc(root, report)
    if run_id and tracking_uri:
        check_mlflow(run_id, tracking_uri, report)
    else:
        report.notes.append("no MLflow run checked (tracking off, or no reports/train.json)")
    return report


def verify_outputs(outputs: Path, tracking_uri: str | None) -> str:
    """`batchlab verify`: the DVC repo here and the MLflow run of `outputs`/reports/train.json; the
    report's lines, or IntegrityError naming how many files differ."""
    from batchlab.tracking import quiet_mlflow
    from batchlab.tracking.backend import preflight

    info = outputs / "reports" / "train.json"
    run_id = json.loads(info.read_text()).get("run_id") if info.is_file() else None
    if tracking_uri and run_id:
        preflight(tracking_uri)
        quiet_mlflow()
    report = verify(Path("."), run_id, tracking_uri)
    if report.mismatches:
        print("\n".join(report.lines()))
        raise IntegrityError(f"{len(report.mismatches)} files differ from their recorded hashes (above)")
    return "\n".join(report.lines())
