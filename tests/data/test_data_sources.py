"""Reading rows from JSONL, Parquet and save_to_disk directories; formats; bad rows; hub ids offline."""

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jgrpo.config import DataConfig
from jgrpo.data import DataSourceError, load_examples
from jgrpo.data.formats import detect_format
from jgrpo.data.sources import read_rows
from tests.helpers import TESTDATA

SAMPLE = TESTDATA / "gsm8k_sample.jsonl"


def _rows():
    return [json.loads(line) for line in SAMPLE.read_text().splitlines()]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The sample written as JSONL, Parquet, a saved Dataset and a saved DatasetDict."""
    import datasets

    root = tmp_path_factory.mktemp("sources")
    rows = _rows()
    pq.write_table(pa.Table.from_pylist(rows), root / "sample.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(root / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:15]),
                          "test": datasets.Dataset.from_list(rows[15:])}).save_to_disk(str(root / "saved_dict"))
    return {"jsonl": str(SAMPLE), "parquet": str(root / "sample.parquet"), "saved": str(root / "saved"),
            "dict": str(root / "saved_dict")}


def _examples(source, **kwargs):
    return load_examples(DataConfig(source=source, **kwargs))


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "saved"])
def test_every_source_type_reads_the_same_examples(sources, kind):
    examples, skipped = _examples(sources[kind])
    expected, _ = _examples(sources["jsonl"])
    assert skipped == 0 and len(examples) == 20
    assert examples == expected
    first = examples[0]
    assert first.question.startswith("Mara buys 3 notebooks")
    assert first.reference["answer"] == "14"  # GSM8K: the text after ####
    assert first.reference["solution"].endswith("#### 14")
    assert [e.reference["answer"] for e in examples[4:5] + examples[8:9]] == ["2,880", "-7"]


def test_saved_dataset_dict_splits(sources):
    train, _ = load_examples(DataConfig(source=sources["dict"]), "train")
    test, _ = load_examples(DataConfig(source=sources["dict"]), "test")
    assert len(train) == 15 and len(test) == 5
    assert {e.question for e in train}.isdisjoint(e.question for e in test)
    with pytest.raises(DataSourceError, match="no split 'validation'.*'train', 'test'"):
        load_examples(DataConfig(source=sources["dict"]), "validation")


def test_split_placeholder_and_single_files(tmp_path):
    rows = _rows()
    for split, part in (("train", rows[:12]), ("test", rows[12:])):
        (tmp_path / f"gsm_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    source = str(tmp_path / "gsm_{split}.jsonl")
    assert len(load_examples(DataConfig(source=source), "test")[0]) == 8
    assert len(load_examples(DataConfig(source=source, split="train"))[0]) == 12
    with pytest.raises(DataSourceError, match=r"single file; to read split 'test' put '\{split\}'"):
        load_examples(DataConfig(source=str(SAMPLE)), "test")


def test_format_detection_and_field_mapping(tmp_path):
    math_rows = [{"problem": "Compute $\\frac{1}{2} + \\frac{1}{4}$.", "answer": "\\frac{3}{4}", "level": 2}]
    assert detect_format(math_rows[0]) == "math"
    assert detect_format(_rows()[0]) == "gsm8k"
    assert detect_format({"q": "x", "a": "1"}) == "custom"
    path = tmp_path / "math.jsonl"
    path.write_text(json.dumps(math_rows[0]) + "\n")
    (example,), _ = load_examples(DataConfig(source=str(path)))
    assert example.question.startswith("Compute") and example.reference == {"answer": "\\frac{3}{4}", "level": 2}

    # AIME releases spell the columns with capitals (ID, Problem, Solution, Answer) and the answer is an integer.
    aime = {"ID": "2024-I-1", "Problem": "Find the remainder when $2^{10}$ is divided by $1000$.", "Answer": 24,
            "Solution": "..."}
    assert detect_format(aime) == "aime"
    (path := tmp_path / "aime.jsonl").write_text(json.dumps(aime) + "\n")
    (example,), _ = load_examples(DataConfig(source=str(path)))
    assert example.question.startswith("Find") and example.reference["answer"] == "24"
    assert example.reference["ID"] == "2024-I-1"

    custom = tmp_path / "custom.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "2+2?", "target": 4}]), custom)
    (example,), _ = load_examples(DataConfig(source=str(custom), question_field="prompt", answer_field="target"))
    assert example.question == "2+2?" and example.reference["answer"] == "4"  # numbers become strings


def _write_bad_jsonl(path: Path) -> None:
    rows = _rows()
    lines = [json.dumps(r) for r in rows[:6]]
    lines[2] = json.dumps({"question": rows[2]["question"]})  # line 3: no answer
    lines[3] = json.dumps({"question": ["not", "text"], "answer": "#### 1"})  # line 4: wrong type
    lines[4] = '{"question": "broken'  # line 5: not JSON
    path.write_text("\n".join(lines) + "\n")


def test_bad_row_error_names_file_row_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    _write_bad_jsonl(path)
    with pytest.raises(DataSourceError, match=r"bad\.jsonl: line 3: missing field 'answer'.*skip_bad_rows"):
        load_examples(DataConfig(source=str(path)))


BAD_ROWS = [
    ({"question": ["not", "text"], "answer": "#### 1"}, r"line 2: field 'question' must be a non-empty string"),
    ({"question": "  ", "answer": "#### 1"}, r"line 2: field 'question' must be a non-empty string"),
    ({"question": "q", "answer": [1]}, r"line 2: field 'answer' must be a string or a number"),
    ({"question": "q", "answer": "no marker"}, r"line 2: field 'answer' has no '#### <final answer>'"),
    ({"question": "q"}, r"line 2: missing field 'answer'"),
    ("[1, 2]", r"line 2: expected an object"),
    ('{"question": "broken', r"line 2: invalid JSON"),
    # Latin-1 bytes from another tool: 0xe9 is the line's 17th byte (offset 16), not UTF-8.
    (b'{"question": "Qu\xe9 es 2 + 2?", "answer": "#### 4"}', r"line 2: not valid UTF-8 at byte 16 of the line"),
]


def _one_bad(path: Path, bad) -> None:
    bad = bad if isinstance(bad, bytes) else (bad if isinstance(bad, str) else json.dumps(bad)).encode()
    path.write_bytes(json.dumps(_rows()[0]).encode() + b"\n" + bad + b"\n" + json.dumps(_rows()[1]).encode() + b"\n")


@pytest.mark.parametrize("bad,pattern", BAD_ROWS, ids=[p.split(": ", 1)[1][:24] for _, p in BAD_ROWS])
def test_each_kind_of_bad_row_is_reported_or_skipped_and_counted(tmp_path, bad, pattern, caplog):
    path = tmp_path / "one_bad.jsonl"
    _one_bad(path, bad)
    with pytest.raises(DataSourceError, match=rf"one_bad\.jsonl: {pattern}.*set data\.skip_bad_rows=true"):
        load_examples(DataConfig(source=str(path), format="gsm8k"))
    examples, skipped = load_examples(DataConfig(source=str(path), format="gsm8k", skip_bad_rows=True))
    assert (len(examples), skipped) == (2, 1)
    assert [e.reference["answer"] for e in examples] == ["14", "35"]  # the rows after the bad one are still read
    assert re.search(rf"skipped 1 bad rows of 3; first: .*one_bad\.jsonl: {pattern}", caplog.text)


def test_a_file_of_bad_rows_only_is_an_error_that_says_so(tmp_path):
    path = tmp_path / "all_bad.jsonl"
    path.write_bytes(b'{"question": "q"}\n\xff\xfe\n[1]\n{"answer": "2"}\n')
    with pytest.raises(DataSourceError, match=r"all 4 rows are bad, nothing to train on; the first: .*line 1: "
                                              r"missing field 'answer'.*line 2: not valid UTF-8.*line 3: expected"):
        load_examples(DataConfig(source=str(path), format="custom", skip_bad_rows=True))


def test_a_json_file_holding_one_array_of_rows_is_read(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(_rows()[:3] + [{"question": "q"}], indent=2))
    examples, skipped = load_examples(DataConfig(source=str(path), skip_bad_rows=True))
    assert [e.reference["answer"] for e in examples] == ["14", "35", "210"] and skipped == 1
    with pytest.raises(DataSourceError, match=r"rows\.json: item 3: missing field 'answer'"):
        load_examples(DataConfig(source=str(path)))


def test_bad_parquet_row_names_file_row_and_field(tmp_path):
    rows = _rows()[:5]
    rows[3] = {"question": None, "answer": rows[3]["answer"]}
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataSourceError, match=r"bad\.parquet: row 3: missing field 'question'"):
        load_examples(DataConfig(source=str(path)))
    examples, skipped = load_examples(DataConfig(source=str(path), skip_bad_rows=True))
    assert (len(examples), skipped) == (4, 1)


def test_bad_rows_are_skipped_and_counted_when_configured(tmp_path, caplog):
    path = tmp_path / "bad.jsonl"
    _write_bad_jsonl(path)
    examples, skipped = load_examples(DataConfig(source=str(path), skip_bad_rows=True))
    assert (len(examples), skipped) == (3, 3)
    assert [e.reference["answer"] for e in examples] == ["14", "35", "80"]
    assert "skipped 3 bad rows of 6" in caplog.text


def test_missing_paths_and_unreachable_hub_ids(tmp_path, monkeypatch):
    with pytest.raises(DataSourceError, match="no such file"):
        load_examples(DataConfig(source=str(tmp_path / "nope.jsonl")))
    with pytest.raises(DataSourceError, match="unsupported file type '.csv'"):
        (tmp_path / "x.csv").write_text("a,b\n")
        read_rows(str(tmp_path / "x.csv"), "train")
    with pytest.raises(DataSourceError, match="no state.json"):
        read_rows(str(tmp_path), "train")
    import datasets
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no warm cache to fall back on
    with pytest.raises(DataSourceError, match=r"not a local path, and loading it from the hub failed.*Offline\?"):
        load_examples(DataConfig(source="jgrpo-test/no-such-dataset"))
