"""The fuzzer's generators: nasty CSV, Parquet, .npy/.npz and params.yaml files (hypothesis
strategies), and the checks every reader's answer must pass (tests/test_fuzz.py explains them)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from hypothesis import HealthCheck, currently_in_test_context, event, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tests.support import REPO, TINY

RANDOM = "BATCHLAB_FUZZ_EXAMPLES" in os.environ


FUZZ = settings(
    max_examples=int(os.environ.get("BATCHLAB_FUZZ_EXAMPLES", "300")),
    derandomize=not RANDOM,
    deadline=None,
    database=None,  # no .hypothesis/ folder in the work tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


CLI = settings(FUZZ, max_examples=2, derandomize=True)  # each a real `batchlab` process (~1-3 s), + a good file


FEATURES = [f"x{i}" for i in range(TINY["data"]["features"])]  # the tiny model's input columns


CLASSES = ["0", "1"]


# an object array's pickle whose loading would create this file: np.load must never unpickle a user's file
TRAP_FILE = Path(tempfile.gettempdir()) / f"batchlab-fuzz-unpickled-{os.getpid()}"


class Trap:
    """Unpickled, it creates TRAP_FILE (pickle calls open(TRAP_FILE, "w"))."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(TRAP_FILE), "w"))


def dump(write: Callable[[io.BytesIO], Any]) -> bytes:
    """What `write` writes into a file object."""
    buffer = io.BytesIO()
    write(buffer)
    return buffer.getvalue()


def damaged(draw: st.DrawFn, blob: bytes) -> bytes:
    """Mostly the file as written; else truncated, overwritten in the middle, padded, or prefixed."""
    how = draw(st.sampled_from(["none"] * 5 + ["truncate", "overwrite", "append", "bom"]))
    if how == "truncate" and blob:
        return blob[: draw(st.integers(0, len(blob) - 1))]
    if how == "overwrite" and blob:
        at = draw(st.integers(0, len(blob) - 1))
        junk = draw(st.binary(min_size=1, max_size=16))
        return blob[:at] + junk + blob[at + len(junk) :]
    if how == "append":
        return blob + draw(st.binary(min_size=1, max_size=32))
    if how == "bom":
        return b"\xef\xbb\xbf" + blob
    return blob


FINITE = st.floats(-1e6, 1e6).map(repr)


NASTY_NUMBER = st.sampled_from([
    "nan", "NaN", "inf", "-inf", "Infinity", "1e308", "-1.7976931348623157e308", "1e400", "4.9e-324", "1e38",
    "3.5e38", "0x1F", "1_000", "1,5", " 1 ", "+1", ".5", "5.", "1e", "--1", "99999999999999999999999", "-0",
    "1.0.0", "１２", "٣",
])  # fmt: skip


JUNK = st.text(max_size=6) | st.sampled_from(
    ["", "abc", "True", "false", "NULL", "None", "N/A", "#N/A", '"', '"a,b"', "é", "日本", "\ufeff", "\x00", "1;2"]
)


CELL = st.one_of(FINITE, FINITE, FINITE, NASTY_NUMBER, JUNK)


EXTRA_NAMES = ["id", "target", "predicted", "proba_0", "", "X0", "x0 ", " x1", "日本", "\ufeffx0", "x0.1", "Unnamed: 0"]


NAME = st.sampled_from(EXTRA_NAMES) | st.text(max_size=5)


@st.composite
def headers(draw: st.DrawFn, wanted: list[str]) -> list[str]:
    """`wanted` in any order, sometimes with some left out, others added, one duplicated; or any names."""
    if draw(st.integers(0, 7)) == 0:
        return draw(st.lists(NAME, max_size=10))
    names = list(draw(st.permutations(wanted)))
    if draw(st.integers(0, 3)) == 0:
        drop = draw(st.sets(st.sampled_from(names), max_size=2))
        names = [n for n in names if n not in drop]
    for extra in draw(st.lists(NAME, max_size=3)):
        names.insert(draw(st.integers(0, len(names))), extra)
    if names and draw(st.integers(0, 5)) == 0:
        names.append(draw(st.sampled_from(names)))
    return names


def plain(draw: st.DrawFn, rows: int, columns: int) -> np.ndarray:
    """Plain values for a fine file, from a seeded generator (drawing each one is most of the fuzzer's time)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return rng.normal(0, draw(st.sampled_from([1.0, 1e3, 1e30])), (rows, columns))


FINE_ROWS = st.integers(0, 2) | st.integers(12, 30)  # none, a few, or enough to split train/val/test


@st.composite
def csv_files(draw: st.DrawFn, wanted: list[str], label: str | None = None, labels: list[str] = CLASSES) -> bytes:
    """A CSV meant to hold the columns `wanted` (and the class column `label`): a third of them fine (any
    order, maybe an extra column, a BOM or CRLF), the rest anything from random bytes to a near miss."""
    kind = draw(st.sampled_from(["nasty"] * 6 + ["fine"] * 4 + ["bytes", "empty", "blank lines"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "empty":
        return b""
    if kind == "blank lines":
        return b"\n" * draw(st.integers(1, 3))
    everything = [*wanted, *([label] if label else [])]
    if kind == "fine":
        columns = list(draw(st.permutations(everything))) + draw(st.lists(st.sampled_from(["id", "note"]), max_size=1))
        n = draw(FINE_ROWS)
        values = plain(draw, n, len(columns)).tolist()
        classes = np.random.default_rng(n).choice(labels, n)
        lines = [",".join(columns)] + [
            ",".join(str(classes[i]) if c == label else repr(v) for c, v in zip(columns, row, strict=True))
            for i, row in enumerate(values)
        ]
        newline = draw(st.sampled_from(["\n", "\r\n"]))
        return (newline.join(lines) + newline).encode(draw(st.sampled_from(["utf-8", "utf-8-sig"])))
    columns = draw(headers(everything))
    classes = st.sampled_from(labels) | CELL
    delimiter = draw(st.sampled_from([",", ",", ",", ";", "\t", "|", " "]))
    newline = draw(st.sampled_from(["\n", "\n", "\r\n", "\r"]))
    lines = [delimiter.join(columns)]
    for _ in range(draw(st.integers(0, 12))):
        cells = [draw(classes if c == label else CELL) for c in columns]
        if draw(st.integers(0, 9)) == 0:  # a ragged row
            cells = cells[: draw(st.integers(0, len(cells)))] + draw(st.lists(CELL, max_size=2))
        lines.append(delimiter.join(cells))
    text = newline.join(lines) + draw(st.sampled_from([newline, ""]))
    encoding = draw(st.sampled_from(["utf-8"] * 4 + ["utf-16", "latin-1"]))
    return damaged(draw, text.encode(encoding, errors="replace"))


def column(draw: st.DrawFn, n: int) -> pa.Array:
    """One Parquet column of `n` rows of a type drawn: numbers mostly, and what pandas makes objects of."""
    floats = st.floats(-1e6, 1e6) if draw(st.booleans()) else st.floats() | st.none()
    kind = draw(st.sampled_from(["float"] * 6 + [
        "int", "uint64", "string", "numeric string", "bool", "null", "list", "struct", "timestamp", "duration",
        "dictionary", "float dictionary", "binary", "decimal", "float32",
    ]))  # fmt: skip
    if kind == "float":
        return pa.array(draw(st.lists(floats, min_size=n, max_size=n)), pa.float64())
    if kind == "float32":
        return pa.array(np.asarray(draw(st.lists(st.floats(width=32), min_size=n, max_size=n)), np.float32))
    if kind == "int":
        return pa.array(draw(st.lists(st.integers(-(2**63), 2**63 - 1) | st.none(), min_size=n, max_size=n)))
    if kind == "uint64":
        return pa.array(draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n)), pa.uint64())
    if kind in ("string", "dictionary"):
        column = pa.array(draw(st.lists(JUNK | st.none(), min_size=n, max_size=n)), pa.string())
        return column.dictionary_encode() if kind == "dictionary" else column
    if kind == "numeric string":
        return pa.array(draw(st.lists(FINITE | NASTY_NUMBER, min_size=n, max_size=n)), pa.string())
    if kind == "bool":
        return pa.array(draw(st.lists(st.booleans() | st.none(), min_size=n, max_size=n)), pa.bool_())
    if kind == "null":
        return pa.nulls(n)
    if kind == "list":
        return pa.array(draw(st.lists(st.lists(floats, max_size=3) | st.none(), min_size=n, max_size=n)))
    if kind == "struct":
        return pa.array(draw(st.lists(st.fixed_dictionaries({"a": floats}), min_size=n, max_size=n)))
    if kind in ("timestamp", "duration"):
        ints = draw(st.lists(st.integers(-(2**40), 2**40), min_size=n, max_size=n))
        return pa.array(ints, pa.timestamp("s") if kind == "timestamp" else pa.duration("s"))
    if kind == "float dictionary":
        return pa.array(draw(st.lists(floats, min_size=n, max_size=n)), pa.float64()).dictionary_encode()
    if kind == "binary":
        return pa.array(draw(st.lists(st.binary(max_size=4), min_size=n, max_size=n)), pa.binary())
    decimals = st.decimals(-(10**6), 10**6, places=2, allow_nan=False, allow_infinity=False)
    return pa.array(draw(st.lists(decimals.map(Decimal), min_size=n, max_size=n)), pa.decimal128(12, 2))


@st.composite
def parquet_files(draw: st.DrawFn) -> bytes:
    """A Parquet table meant to hold the 8 features: a third fine (float, float32 or int columns, maybe an
    id), the rest of columns of any type, in row groups of any size, damaged, or random bytes."""
    kind = draw(st.sampled_from(["nasty"] * 5 + ["fine"] * 3 + ["bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "fine":
        names = list(draw(st.permutations(FEATURES))) + draw(st.lists(st.just("id"), max_size=1))
        n = draw(FINE_ROWS)
        values = plain(draw, n, len(names))
        dtypes = draw(st.lists(st.sampled_from(["f8", "f4", "i8"]), min_size=len(names), max_size=len(names)))
        values = np.clip(values, -1e15, 1e15)  # int64 holds them
        columns = [pa.array([f"r{i}" for i in range(n)]) if name == "id" else pa.array(values[:, j].astype(t))
                   for j, (name, t) in enumerate(zip(names, dtypes, strict=True))]  # fmt: skip
        table = pa.Table.from_arrays(columns, names=names)
        buffer = io.BytesIO()
        pq.write_table(table, buffer, row_group_size=draw(st.sampled_from([None, 1, 3])))
        return buffer.getvalue()
    names = draw(headers(FEATURES))
    n = draw(st.integers(0, 8))
    table = pa.Table.from_arrays([column(draw, n) for _ in names], names=names)
    if len(set(names)) == len(names) and draw(st.integers(0, 4)) == 0:  # pandas' metadata: a string index
        with contextlib.suppress(ValueError):  # columns pandas cannot convert (predict is given them as they are)
            frame = table.to_pandas()
            frame.index = pd.Index([f"r{i}" for i in range(n)], dtype=object)
            table = pa.Table.from_pandas(frame, preserve_index=True)
    buffer = io.BytesIO()
    pq.write_table(table, buffer, row_group_size=draw(st.sampled_from([None, 1, 3])))
    return damaged(draw, buffer.getvalue())


ELEMENTS = st.one_of(st.none(), st.integers(), st.floats(), st.text(max_size=3), st.just(Trap()))


DTYPES = st.one_of(
    hnp.scalar_dtypes(),
    hnp.floating_dtypes(endianness="?"),
    hnp.byte_string_dtypes(max_len=3),
    hnp.unicode_string_dtypes(max_len=3),
    hnp.array_dtypes(max_size=2),
    st.just(np.dtype(object)),
)


@st.composite
def arrays(draw: st.DrawFn, shape: tuple[int, ...]) -> np.ndarray:
    """An array of `shape`: plain numbers half the time, else any dtype (objects too) with any values."""
    if draw(st.booleans()):
        dtype = draw(st.sampled_from([np.float64, np.float32, np.int64]))
        elements = st.integers(-100, 100) if dtype == np.int64 else st.floats(-100, 100, width=32)
        return draw(hnp.arrays(dtype, shape, elements=elements))
    dtype = draw(DTYPES)
    array = draw(hnp.arrays(dtype, shape, elements=ELEMENTS if dtype.kind == "O" else None))
    return np.asfortranarray(array) if draw(st.booleans()) else array


def saved(draw: st.DrawFn, named: dict[str, np.ndarray], npz: bool, damage: bool = True) -> bytes:
    buffer = io.BytesIO()
    with warnings.catch_warnings():  # numpy's note that unicode field names need format 3.0
        warnings.simplefilter("ignore", UserWarning)
        if npz:
            (np.savez_compressed if draw(st.booleans()) else np.savez)(buffer, **named)
        else:
            np.save(buffer, next(iter(named.values())), allow_pickle=True)
    blob = buffer.getvalue()
    if not npz and draw(st.integers(0, 9)) == 0:  # the header says another shape or dtype than the data has
        blob = re.sub(rb"'shape': \([0-9, ]*\)", draw(st.sampled_from([b"'shape': (1152921504606846976, 8)",
                      b"'shape': (3, 8)", b"'shape': ()", b"'shape': (-1, 8)"])), blob, count=1)  # fmt: skip
        blob = re.sub(rb"'descr': '[^']*'", draw(st.sampled_from([b"'descr': '<f8'", b"'descr': '|O'",
                      b"'descr': 'zz'"])), blob, count=1)  # fmt: skip
    return damaged(draw, blob) if damage else blob


@st.composite
def predict_arrays(draw: st.DrawFn) -> tuple[bytes, str]:
    """An .npy (or an .npz's x) meant to be (rows, 8 features), and its suffix."""
    n = draw(st.integers(0, 12))
    shape = draw(st.sampled_from([(n, 8)] * 4 + [(n,), (n, 7), (n, 9), (n, 8, 1), (), (8,), (n, 0)]))
    npz = draw(st.integers(0, 3)) == 0
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=200)), ".npz" if npz else ".npy"
    key = draw(st.sampled_from(["x", "x", "x", "y", "X", "arr_0"]))
    return saved(draw, {key: draw(arrays(shape))}, npz), ".npz" if npz else ".npy"


@st.composite
def source_npz(draw: st.DrawFn) -> bytes:
    """data.source npz: x (N, ...) and y (N labels), more or less."""
    kind = draw(st.sampled_from(["nasty"] * 5 + ["fine"] * 3 + ["bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "fine":  # rows or images of plain numbers, or token ids; two or three classes (as ints or strings)
        n = draw(st.integers(12, 40))
        y = np.random.default_rng(n).integers(0, draw(st.integers(2, 3)), n)
        y = y.astype(draw(st.sampled_from([np.int64, "U1"])))
        if draw(st.integers(0, 3)) == 0:  # token ids (N, T) with their vocab, as the transformer takes them
            vocab = draw(st.integers(2, 50))
            ids = draw(hnp.arrays(draw(st.sampled_from([np.int64, np.int32, np.uint8])), (n, draw(st.integers(1, 6))),
                                  elements=st.integers(0, vocab - 1)))  # fmt: skip
            return saved(draw, {"x": ids, "y": y, "vocab": np.array(vocab)}, npz=True, damage=False)
        shape = draw(st.sampled_from([(n, 3), (n, 2, 2), (n, 1, 2, 2)]))
        x = plain(draw, n, int(np.prod(shape[1:]))).reshape(shape).astype(draw(st.sampled_from(["f8", "f4"])))
        return saved(draw, {"x": x, "y": y}, npz=True, damage=False)
    n = draw(st.integers(0, 12))
    x_shape = draw(st.sampled_from([(n, 3)] * 4 + [(n,), (n, 0), (n, 2, 2), (n, 1, 2, 2), (n, 1, 1, 1, 1), ()]))
    y_shape = draw(st.sampled_from([(n,)] * 4 + [(n + 1,), (n, 1), ()]))
    if draw(st.booleans()):
        y = draw(hnp.arrays(np.int64, y_shape, elements=st.integers(0, 2)))
        y = y.astype(draw(st.sampled_from([np.int64, np.int8, np.float32, "U2", "S1"])))
    else:
        y = draw(arrays(y_shape))
    named = {"x": draw(arrays(x_shape)), "y": y}
    if draw(st.integers(0, 3)) == 0:  # a vocab: x is then token ids, whatever x and the vocab hold
        named["vocab"] = draw(st.one_of(arrays(draw(st.sampled_from([(), (), (1,), (2,)]))),
                                        st.integers(-3, 2**40).map(np.array)))  # fmt: skip
    for key in draw(st.sets(st.sampled_from(["x", "y"]), max_size=1)):
        named[key.upper()] = named.pop(key)  # one array under a wrong name
    return saved(draw, named, npz=True)


PARAMS_YAML = (REPO / "params.yaml").read_bytes()


PARAMS = yaml.safe_load(PARAMS_YAML)


VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.sampled_from(
        ["csv", "npz", "mlp", "cnn", "ddp", "cuda", "bf16", "synthetic", "module:function", "1e-3", "64"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)  # fmt: skip


SAME_TYPE: dict[type, st.SearchStrategy[Any]] = {
    bool: st.booleans(),
    int: st.integers(0, 300),
    float: st.floats(0, 1),
    list: st.lists(st.integers(1, 64), max_size=4),
}


NESTED = ["train:\n  lr: {}\n", "model:\n  hidden_sizes: {}\n", "{}\n", "data: {}\n"]


TEXT_DOCUMENTS = [
    "", "---\n", "...\n", "[]\n", "- data\n- model\n", "just a string\n", "42\n", "null\n", "~\n",
    "data: 1\n---\nb: 2\n", "data: !!python/object/apply:builtins.open ['{trap}', 'w']\n",
    "data: !!binary aGVsbG8=\n", "data: !!set {{a, b}}\n", "data: 2024-01-01\n", "data:\n\tsource: csv\n",
    "data: [1, 2\n", "data: {{a: 1\n", "'unclosed: 1\n", "a: b: c\n", "data: &a {{source: csv}}\nmodel: *a\n",
    "data: *nowhere\n", "<<: {{data: 1}}\n", "? [a, b]\n: 1\n", "%YAML 9.9\n---\n",
    "data:\n  source: synthetic\n  source: csv\n", "\x00data: 1\n", "data: \x07\n", "\ufeffdata: {{}}\n",
]  # fmt: skip


@st.composite
def params_files(draw: st.DrawFn) -> bytes:
    """params.yaml: the repo's with keys retyped, dropped, added or given values of their own type (a third:
    valid unless a value breaks a rule), a section an alias of another, anchors of anchors, deep nesting,
    a YAML edge case, another encoding, random bytes."""
    kind = draw(st.sampled_from(["tweaked"] * 4 + ["mutated"] * 4 + ["text", "nested", "laughs", "bytes", "latin-1",
                                                                    "aliases"]))  # fmt: skip
    if kind == "tweaked":
        params = {k: dict(v) for k, v in PARAMS.items()}
        for _ in range(draw(st.integers(0, 3))):
            section = draw(st.sampled_from(sorted(params)))
            key = draw(st.sampled_from(sorted(params[section])))
            params[section][key] = draw(SAME_TYPE.get(type(params[section][key]), st.just(params[section][key])))
        return document(params).encode()
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "text":
        return draw(st.sampled_from(TEXT_DOCUMENTS)).format(trap=TRAP_FILE).encode()
    if kind == "nested":
        depth = draw(st.sampled_from([10, 40, 300, 500]))  # 500: past what PyYAML can recurse into
        inner = draw(st.sampled_from(["[" * depth + "]" * depth, "{a: " * depth + "1" + "}" * depth]))
        return document(PARAMS).encode() + draw(st.sampled_from(NESTED)).format(inner).encode()
    if kind == "laughs":  # model.kwargs' levels each refer to the last ten times over: 10**depth values expanded
        depth = draw(st.integers(1, 12))
        levels = ["l0: &l0 [lol]"] + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, depth + 1)]
        params = {k: dict(v) for k, v in PARAMS.items()}
        if draw(st.booleans()):  # valid keys: the config itself holds them (a factory takes any kwargs)
            params["model"]["factory"] = "usermodels.mine:build"
        else:  # a wrong type: the error message shows the value
            params["train"]["lr"] = "LR"
        text = document(params).replace("  kwargs: {}\n", "".join(f"    {level}\n" for level in ["kwargs:", *levels]))
        return text.replace("    kwargs:", "  kwargs:").replace("lr: LR", f"lr: *l{depth}").encode()
    params: dict[str, Any] = {k: dict(v) for k, v in PARAMS.items()}
    for _ in range(draw(st.integers(1, 4))):
        section = draw(st.sampled_from([*params, "extra"]))
        keys = list(params.get(section) or {}) if isinstance(params.get(section), dict) else []
        key = draw(st.sampled_from([*keys, "unknown"])) if keys else "unknown"
        action = draw(st.sampled_from(["value"] * 4 + ["drop key", "drop section", "section value"]))
        if action == "value" and isinstance(params.get(section), dict):
            params[section][key] = draw(VALUES)
        elif action == "drop key" and isinstance(params.get(section), dict):
            params[section].pop(key, None)
        elif action == "drop section":
            params.pop(section, None)
        else:
            params[section] = draw(VALUES)
    text = document(params)
    if kind == "aliases":  # a section is an alias of another
        text = text.replace("data:", "data: &d", 1) + "\n" if "data:" in text else text
        text = re.sub(r"(?m)^model:\n(  .*\n)*", "model: *d\n", text) if "&d" in text else text
    if kind == "latin-1":
        return ("# café\n" + text).encode("latin-1", errors="replace")
    top = draw(st.sampled_from(["mapping"] * 8 + ["list", "scalar"]))
    if top == "list":
        text = yaml.safe_dump([params])
    elif top == "scalar":
        text = yaml.safe_dump(draw(VALUES))
    return damaged(draw, text.encode())


def document(params: dict[str, Any], skip: frozenset[str] = frozenset()) -> str:
    kept = {k: v for k, v in params.items() if k not in skip}
    return yaml.dump(kept, Dumper=yaml.CSafeDumper, sort_keys=False, allow_unicode=True)


DETAILS = re.compile(r"'[^']*'|\[[^]]*\]|\([^)]*\)|[0-9][0-9.e+-]*|/[^ :]*")  # what varies in a message


def one_line(err: BaseException) -> str:
    """The error's message, checked to be one line; its kind counted (pytest --hypothesis-show-statistics)."""
    message = str(err)
    assert len(message.splitlines()) == 1 and message.strip(), repr(message)
    if currently_in_test_context():
        event(f"refused: {DETAILS.sub('…', message)[:70]}")
    return message


def valid(what: str) -> None:
    if currently_in_test_context():
        event(f"valid {what}")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The reader warns of nothing: on the CLI a warning is more lines of stderr before the one line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    shown = [f"{w.category.__name__}: {w.message}" for w in caught if not issubclass(w.category, DeprecationWarning)]
    assert not shown, shown


def nothing_unpickled() -> None:
    assert not TRAP_FILE.exists(), "np.load unpickled a user's object array (allow_pickle=True)"
