"""Read raw rows from a local JSONL / Parquet file, a `datasets.save_to_disk` directory, or a hub dataset id.

Every row keeps where it came from (file and row), so a bad row can be reported precisely later.
A path may contain `{split}` (e.g. `data/gsm8k_{split}.jsonl`) to select a split; a directory saved from a
`DatasetDict` holds its splits itself. A single file without `{split}` is the train split only, so an
evaluation can never silently run on training data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from jgrpo.config.errors import DataError

# The generated datasets `data.source` can name instead of a path or hub id (`jgrpo.data.pipeline` builds them).
BUILTIN_TASKS = ("arithmetic", "countdown", "word_problems")


class DataSourceError(DataError):
    """A data source or row that cannot be read; the message names the file and row."""


@dataclass(frozen=True)
class RawRow:
    fields: object  # a dict for well-formed rows; anything for malformed JSONL lines (reported later)
    where: str  # "path: line 7" / "path: row 6", for error messages


_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


class Malformed:
    """Stands in for a row that could not even be parsed, so skip_bad_rows can skip it like any other."""

    def __init__(self, reason: str):
        self.reason = reason


def _read_jsonl(path: Path) -> list[RawRow]:
    """One row per non-blank line. Lines are decoded one at a time, so a line of other bytes than UTF-8 (a file
    from another tool, a truncated write) is one bad row, reported or skipped like any other, not the file's end."""
    rows = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}: line {line_no}"
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")  # a BOM may open the file
            except UnicodeDecodeError as e:
                rows.append(RawRow(Malformed(f"not valid UTF-8 at byte {e.start} of the line"), where))
                continue
            if not line.strip():
                continue
            try:
                rows.append(RawRow(json.loads(line), where))
            except json.JSONDecodeError as e:
                rows.append(RawRow(Malformed(f"invalid JSON ({e.msg} at column {e.colno})"), where))
    return rows


def _table_rows(table: pa.Table, path: Path) -> list[RawRow]:
    return [RawRow(fields, f"{path}: row {i}") for i, fields in enumerate(table.to_pylist())]


def _read_arrow_stream(path: Path) -> pa.Table:
    # save_to_disk writes Arrow IPC *stream* files; older versions wrote the file format.
    with pa.memory_map(str(path)) as source:
        try:
            return pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            source.seek(0)
            return pa.ipc.open_file(source).read_all()


def _read_saved_dataset(directory: Path, split: str, has_placeholder: bool) -> list[RawRow]:
    if (directory / "dataset_dict.json").is_file():
        splits = json.loads((directory / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits:
            raise DataSourceError(f"{directory}: no split {split!r} in this saved DatasetDict (splits: {splits})")
        directory = directory / split
    elif split != "train" and not has_placeholder:
        raise DataSourceError(f"{directory} is a single saved dataset; to read split {split!r} put '{{split}}' "
                              "in the path or save a DatasetDict")
    state_file = directory / "state.json"
    if not state_file.is_file():
        raise DataSourceError(f"{directory}: no state.json, not a directory written by datasets' save_to_disk")
    files = [entry["filename"] for entry in json.loads(state_file.read_text()).get("_data_files", [])]
    if not files:
        raise DataSourceError(f"{state_file}: lists no data files")
    rows: list[RawRow] = []
    for name in files:
        rows += _table_rows(_read_arrow_stream(directory / name), directory / name)
    return rows


def _read_json_array(path: Path) -> list[RawRow] | None:
    """The rows of a `.json` file holding one JSON array of objects (what many tools write); None otherwise."""
    with path.open("rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if not head.startswith(b"["):
        return None
    try:
        items = json.loads(path.read_bytes().decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataSourceError(f"{path}: starts like a JSON array but cannot be parsed as one ({e}); write one "
                              "JSON object per line (JSONL) or fix the file") from None
    if not isinstance(items, list):
        return None
    return [RawRow(item, f"{path}: item {i}") for i, item in enumerate(items)]


def _read_file(path: Path) -> list[RawRow]:
    if path.suffix == ".json" and (rows := _read_json_array(path)) is not None:
        return rows
    if path.suffix in _JSONL_SUFFIXES:
        return _read_jsonl(path)
    if path.suffix == ".parquet":
        try:
            return _table_rows(pq.read_table(path), path)
        except (pa.ArrowException, OSError) as e:
            raise DataSourceError(f"{path}: not a readable Parquet file ({e})") from None
    raise DataSourceError(f"{path}: unsupported file type {path.suffix!r} (use .jsonl, .json, .parquet, or a "
                          "save_to_disk directory)")


def _read_hub(source: str, split: str) -> list[RawRow]:
    """`owner/name` or `owner/name:config` through `datasets.load_dataset` (needs network or a warm HF cache)."""
    try:
        import datasets
    except ImportError:
        raise DataSourceError(f"data.source={source!r} is neither a built-in task nor an existing path, and the "
                              "`datasets` package (needed for hub ids) is not installed") from None
    name, _, config = source.partition(":")
    try:
        table = datasets.load_dataset(name, config or None, split=split).data.table
    except Exception as e:  # noqa: BLE001 - offline, unknown id, gated...: all mean the same to the user
        raise DataSourceError(
            f"data.source={source!r} is not a local path, and loading it from the hub failed "
            f"({type(e).__name__}: {e}). Offline? Download it elsewhere and point data.source at a local "
            "JSONL / Parquet file or save_to_disk directory.") from None
    return _table_rows(table, Path(f"hub:{source}[{split}]"))


def locate(source: str, split: str) -> tuple[str, Path]:
    """("dir" | "file" | "hub", path) of `source` for `split`, without reading it: a local path that does not
    exist (or a single file asked for another split) fails here, so a run can check its data before it loads
    a model."""
    has_placeholder = "{split}" in source
    path = Path(source.replace("{split}", split)).expanduser()
    if path.is_dir():
        return "dir", path
    if path.is_file():
        if split != "train" and not has_placeholder:
            raise DataSourceError(f"{path} is a single file; to read split {split!r} put '{{split}}' in "
                                  f"data.source (e.g. data/name_{{split}}.jsonl)")
        return "file", path
    looks_local = has_placeholder or path.suffix in (*_JSONL_SUFFIXES, ".parquet") or source.startswith((".", "/"))
    if looks_local or source.count("/") > 1:
        raise DataSourceError(f"data.source={source!r}: no such file or directory ({path}); give a JSONL / Parquet "
                              f"file, a save_to_disk directory, a built-in task ({', '.join(BUILTIN_TASKS)}) or a "
                              "hub id")
    return "hub", path


def read_rows(source: str, split: str) -> list[RawRow]:
    """All rows of `source` for `split`, in storage order."""
    kind, path = locate(source, split)
    if kind == "dir":
        return _read_saved_dataset(path, split, "{split}" in source)
    if kind == "file":
        return _read_file(path)
    return _read_hub(source, split)
