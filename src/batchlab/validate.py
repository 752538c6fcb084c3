"""`batchlab validate`: reject a bad params.yaml before any stage's outputs are removed.

DVC deletes a stage's outputs before its command runs, so a bad value caught inside `train`
has already cost the last good model and reports (`cache: false` ones cannot be checked out
again). dvc.yaml makes every stage depend on this stage's stamp. The stamp's content never
changes, so a valid edit reruns only the stages that read the changed keys; an invalid one
stops `dvc repro` here. Imports neither torch nor mlflow: it runs on every params change.
"""

from __future__ import annotations

import csv
from pathlib import Path

from batchlab import atomic
from batchlab.config import Config, ConfigError, DataConfig
from batchlab.data import split_sizes

STAMP = Path(".batchlab") / "params.ok"
STAMP_TEXT = "params.yaml passed `batchlab validate`\n"  # constant: see the module docstring
RAW_DATA = Path("data") / "raw"  # generate's data dependency in dvc.yaml
BUNDLED_ROWS = {"breast_cancer": 569, "digits": 1797, "digits_images": 1797, "wine": 178, "iris": 150}
DASK_SCHEMES = ("tcp", "tls", "ws", "wss", "ucx")  # distributed's network comms (inproc: one process only)


def train_rows(cfg: DataConfig, root: Path = Path(".")) -> int | None:
    """Rows the train split will have, from the params alone (scikit-learn's split arithmetic);
    None when that needs the data (a CSV that cannot be read yet: generate reports why)."""
    if cfg.source in ("synthetic", "sequences"):
        rows = cfg.samples
    elif cfg.source == "npz":
        from batchlab.data.sources import UNREADABLE_ARRAYS

        try:
            import numpy as np

            # opened here: np.load leaves the file it opened open when it is not a zip after all
            with (root / (cfg.npz_path or "")).open("rb") as raw, np.load(raw, allow_pickle=False) as arrays:
                rows = len(arrays["y"])
        # what np.load raises on a bad file (the npz source's own list), no y, a 0-d y (TypeError):
        # generate names what is wrong
        except (*UNREADABLE_ARRAYS, KeyError, TypeError):
            return None
    elif cfg.source == "csv":
        try:
            with (root / (cfg.csv_path or "")).open(newline="") as f:
                rows = sum(1 for _ in csv.reader(f)) - 1  # minus the header
        except (OSError, UnicodeDecodeError, csv.Error):
            return None
    else:
        rows = BUNDLED_ROWS[cfg.source]
    return split_sizes(rows, cfg.test_fraction, cfg.val_fraction / (1 - cfg.test_fraction))[0]


def batch_fits(batch_size: int, n_train: int, key: str) -> None:
    """A batch fills at least one step of the train split (every step is a full batch)."""
    if batch_size > n_train:
        raise ConfigError(f"{key} ({batch_size}) is larger than the train split ({n_train} rows)")


def batches_fit(cfg: Config, n_train: int) -> None:
    """Every batch size the params ask for fills at least one step of the train split."""
    batch_fits(cfg.train.batch_size, n_train, "train.batch_size")
    too_big = [b for b in cfg.sweep.batch_sizes if b > n_train]
    if too_big:
        raise ConfigError(f"sweep.batch_sizes {too_big} are larger than the train split ({n_train} rows)")
    if cfg.sweep.local_cbs:
        if cfg.train.strategy != "single":
            raise ConfigError(f"sweep.local_cbs branches on one process; train.strategy is {cfg.train.strategy}: set "
                              "train.strategy: single for the study, or sweep.local_cbs: false")
        if cfg.train.precision == "fp16":
            raise ConfigError("sweep.local_cbs branches without fp16's grad scaler: set train.precision bf16 or "
                              "fp32 for the study, or sweep.local_cbs: false")
        if (cfg.sweep.epochs or cfg.train.epochs) < 2:
            raise ConfigError("sweep.local_cbs branches at an epoch's end inside the run: it needs sweep.epochs "
                              "(or train.epochs) of at least 2")
        base, multipliers = cfg.train.batch_size, cfg.sweep.local_cbs_multipliers
        too_big = [k for k in multipliers if k * base > n_train]
        if too_big:
            fit = [k for k in multipliers if k * base <= n_train]
            raise ConfigError(f"sweep.local_cbs_multipliers {too_big} make branches larger than the train split "
                              f"({n_train} rows at train.batch_size {base}): use at most {n_train // base}, e.g. "
                              f"{fit}")


def csv_inside_raw(cfg: DataConfig) -> None:
    """DVC sees a CSV or an .npz only as part of generate's dependency data/raw/: a file elsewhere
    could be edited without any stage rerunning."""
    if cfg.source not in ("csv", "npz"):
        return
    key = f"data.{cfg.source}_path"
    path = Path((cfg.csv_path if cfg.source == "csv" else cfg.npz_path) or "")
    if path.is_absolute() or RAW_DATA not in (path.parent, *path.parent.parents):
        raise ConfigError(
            f"{key} must be a file under {RAW_DATA}/ (generate's DVC dependency), got {str(path)!r}; "
            f"move it there, e.g. {RAW_DATA / path.name}"
        )


IMAGE_SOURCES = {"digits_images"}  # the other named sources but sequences give feature rows
MODEL_TAKES = {"mlp": "rows", "cnn": "images", "transformer": "tokens"}  # as model.builtin builds them
KIND_WORDS = {"rows": "feature rows (N, F)", "images": "images (N, C, H, W)", "tokens": "token ids (N, T) with a vocab"}
SOURCES_OF = {
    "rows": "data.source synthetic, csv, breast_cancer, digits, wine, iris or an .npz with x (N, F)",
    "images": "data.source digits_images or an .npz with x (N, H, W) or (N, C, H, W)",
    "tokens": "data.source sequences or an .npz with x (N, T) and an integer vocab",
}


def data_kind(cfg: DataConfig, root: Path = Path(".")) -> str | None:
    """rows, images or tokens: what data.source gives, from the params (an .npz: from its header
    alone); None when only reading the data can tell (generate reports why)."""
    if cfg.source == "sequences":
        return "tokens"
    if cfg.source != "npz":
        return "images" if cfg.source in IMAGE_SOURCES else "rows"
    import zipfile

    from numpy.lib import format as npy

    from batchlab.data.sources import UNREADABLE_ARRAYS

    try:  # x's header only: the array itself may be large
        with zipfile.ZipFile(root / (cfg.npz_path or "")) as arrays:
            if "vocab.npy" in arrays.namelist():
                return "tokens"
            with arrays.open("x.npy") as x:
                header = npy.read_array_header_1_0 if npy.read_magic(x) == (1, 0) else npy.read_array_header_2_0
                ndim = len(header(x)[0])
    except (*UNREADABLE_ARRAYS, KeyError):
        return None
    return {2: "rows", 3: "images", 4: "images"}.get(ndim)


def model_fits_data(cfg: Config, root: Path = Path(".")) -> None:
    """A built-in model.name takes the kind of examples data.source gives (train would refuse them
    after DVC removed the last model): the MLP rows, the CNN images, the transformer token ids."""
    if cfg.model.factory is not None:
        return  # factory_builds runs it on the data's shape
    kind, takes = data_kind(cfg.data, root), MODEL_TAKES[cfg.model.name]
    if kind is None or kind == takes:
        return
    source = cfg.data.source if cfg.data.source != "npz" else f"npz ({cfg.data.npz_path})"
    fits = next(name for name, k in MODEL_TAKES.items() if k == kind)
    raise ConfigError(f"model.name {cfg.model.name} takes {KIND_WORDS[takes]}, but data.source {source} gives "
                      f"{KIND_WORDS[kind]}: use model.name {fits} for this data, or {SOURCES_OF[takes]}")


def factory_source(spec: str, root: Path = Path(".")) -> Path | None:
    """The file defining model.factory's function, found without importing anything: under the repo
    root (usermodels/…), else an installed package's (None when only importing can tell); a
    ConfigError when the module or the name is not there."""
    import ast
    import importlib.util

    module, _, name = spec.partition(":")
    relative = Path(*module.split("."))
    candidates = [root / relative.with_suffix(".py"), root / relative / "__init__.py"]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None and "." not in module:
        spec_ = importlib.util.find_spec(module)  # a top-level installed module: found, not run
        found = Path(spec_.origin) if spec_ is not None and spec_.origin not in (None, "built-in") else None
        if spec_ is None:
            raise ConfigError(f"model.factory {spec!r}: no module {module!r} (looked for {candidates[0]} and "
                              "installed packages)")
    if found is None:
        return None
    try:
        tree = ast.parse(found.read_text(), str(found))
    except (SyntaxError, UnicodeDecodeError) as err:
        raise ConfigError(f"model.factory {spec!r}: {found} does not parse: {str(err).splitlines()[0]}") from None
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef)}
    defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    defined |= {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom | ast.Import) for a in n.names}
    if name not in defined:
        raise ConfigError(f"model.factory {spec!r}: {found} defines no {name!r}")
    return found


def factory_builds(cfg: Config, root: Path = Path(".")) -> None:
    """model.factory imported, called and run on one batch of the data's shape, in a child process
    (torch stays out of this one): a ConfigError with its one line when it fails."""
    import json

    from batchlab.data import raw_table

    raw = raw_table(cfg.data)
    shape = list(raw.x.shape[1:])  # one example's, as the prepared split will hold it
    args = [cfg.model.model_dump_json(), json.dumps(shape), str(len(raw.class_names)), str(root.resolve())]
    in_child("batchlab.model.factory", args)


def in_child(module: str, args: list[str]) -> None:
    """`python -m module args` (a check that needs torch, away from this torch-free process): its
    last line of error as a ConfigError when it fails."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        lines = (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}").splitlines()
        raise ConfigError(lines[-1].removeprefix("batchlab: error: "))


def runs_here(cfg: Config) -> None:
    """train.device, precision and strategy against this machine's devices (a CUDA device, its
    count, bf16 and fp16 support), checked in a child process (torch stays out of this one) so that
    a run this machine cannot make stops here, before any stage, not in train or after the sweep.
    Params that can only run on the CPU (device cpu, or auto at fp32 on one process) need no look."""
    train = cfg.train
    if train.device == "cpu" or (train.device == "auto" and train.precision == "fp32" and train.strategy == "single"):
        return
    in_child("batchlab.training.support", [train.model_dump_json()])


def dask_address(address: str | None) -> None:
    """sweep.dask_address is [scheme://]host:port, as `dask scheduler` prints it. distributed takes
    anything else for a host and fails in its connect, in a traceback (without importing it here)."""
    if address is None:
        return
    scheme, _, location = address.rpartition("://")
    host, _, port = location.rpartition(":")
    bad_host = not host or any(c.isspace() or c == "/" for c in host)
    if scheme not in ("", *DASK_SCHEMES) or bad_host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"sweep.dask_address must be a Dask scheduler's address, [tcp://]host:port as `dask scheduler` "
            f"prints it (e.g. tcp://10.0.0.5:8786), got {address!r}"
        )


def validate(cfg: Config, root: Path = Path(".")) -> None:
    """Everything that can be checked from the params alone (and model.factory's module: that it
    builds a model for the data); writes the stamp when it passes."""
    csv_inside_raw(cfg.data)
    model_fits_data(cfg, root)
    if cfg.model.factory is not None:
        factory_source(cfg.model.factory, root)
        factory_builds(cfg, root)
    dask_address(cfg.sweep.dask_address)
    runs_here(cfg)
    n_train = train_rows(cfg.data, root)
    if n_train is not None:
        batches_fit(cfg, n_train)
    atomic.write_text(root / STAMP, STAMP_TEXT)
