"""Turn raw rows into examples (question + reference fields) according to the data format.

Formats and the columns they read:
  gsm8k   question <- `question`, answer <- the text after `####` in `answer` (full text kept as `solution`)
  math    question <- `problem`,  answer <- `answer` as written (LaTeX allowed; MATH, DeepScaleR, AIME in
          lower case)
  aime    question <- `Problem`,  answer <- `Answer` (AIME releases' capitalised columns; integers as strings)
  custom  question <- data.question_field, answer <- data.answer_field, as written
  auto    gsm8k if the first row has `question` and an `answer` containing `####`; math if it has `problem`
          and `answer`; aime if it has `Problem` and `Answer`; custom otherwise.
A data.question_field / data.answer_field set to something other than its default overrides the format's
column. Every other column of the row is passed along in the reference (e.g. `numbers`, `target`).
"""

from __future__ import annotations

import dataclasses
import logging

from jgrpo.config import DataConfig
from jgrpo.data.sources import DataSourceError, Malformed, RawRow

log = logging.getLogger("jgrpo.data")

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DataConfig)}
_FORMAT_COLUMNS = {"gsm8k": ("question", "answer"), "math": ("problem", "answer"), "aime": ("Problem", "Answer")}


@dataclasses.dataclass(frozen=True)
class Example:
    question: str
    reference: dict  # always has "answer"; plus the row's other columns
    # "path: line 7" for rows of a file, so a report of a dropped prompt can name it; not part of its identity
    where: str = dataclasses.field(default="", compare=False)


def detect_format(first_row: object) -> str:
    if not isinstance(first_row, dict):
        return "custom"
    answer = first_row.get("answer")
    if "question" in first_row and isinstance(answer, str) and "####" in answer:
        return "gsm8k"
    if "problem" in first_row and "answer" in first_row:
        return "math"
    if "Problem" in first_row and "Answer" in first_row:
        return "aime"
    return "custom"


def resolve_columns(fmt: str, config: DataConfig) -> tuple[str, str]:
    question, answer = _FORMAT_COLUMNS.get(fmt, (config.question_field, config.answer_field))
    if config.question_field != _DEFAULTS["question_field"]:
        question = config.question_field
    if config.answer_field != _DEFAULTS["answer_field"]:
        answer = config.answer_field
    return question, answer


class BadRow(ValueError):
    pass


def _to_example(row: RawRow, fmt: str, q_col: str, a_col: str) -> Example:
    fields = row.fields
    if isinstance(fields, Malformed):
        raise BadRow(f"{row.where}: {fields.reason}")
    if not isinstance(fields, dict):
        raise BadRow(f"{row.where}: expected an object with fields, got {type(fields).__name__}")
    for col in (q_col, a_col):
        if col not in fields or fields[col] is None:
            raise BadRow(f"{row.where}: missing field {col!r} (fields: {', '.join(map(str, fields))})")
    question, answer = fields[q_col], fields[a_col]
    if not isinstance(question, str) or not question.strip():
        raise BadRow(f"{row.where}: field {q_col!r} must be a non-empty string, got {question!r:.80}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise BadRow(f"{row.where}: field {a_col!r} must be a string or a number, got {type(answer).__name__}")
    reference = {k: v for k, v in fields.items() if k != q_col}
    if fmt == "gsm8k":
        if not isinstance(answer, str) or "####" not in answer:
            raise BadRow(f"{row.where}: field {a_col!r} has no '#### <final answer>' (format gsm8k)")
        final = answer.rsplit("####", 1)[1].strip()
        if not final:
            raise BadRow(f"{row.where}: field {a_col!r} has nothing after '####' (format gsm8k)")
        reference["solution"] = answer
        answer = final
    reference["answer"] = answer if isinstance(answer, str) else str(answer)
    return Example(question, reference, row.where)


def rows_to_examples(rows: list[RawRow], config: DataConfig) -> tuple[list[Example], int]:
    """Examples of the well-formed rows and the number of bad rows skipped (only when data.skip_bad_rows).

    Raises DataSourceError at the first bad row otherwise, naming its file, row and field.
    """
    if not rows:
        raise DataSourceError(f"data.source={config.source!r} has no rows")
    fmt = detect_format(rows[0].fields) if config.format == "auto" else config.format
    q_col, a_col = resolve_columns(fmt, config)
    examples, skipped = [], []
    for row in rows:
        try:
            examples.append(_to_example(row, fmt, q_col, a_col))
        except BadRow as e:
            if not config.skip_bad_rows:
                raise DataSourceError(f"{e} (set data.skip_bad_rows=true to skip such rows)") from None
            skipped.append(str(e))
    if skipped:
        log.warning("skipped %d bad rows of %d; first: %s", len(skipped), len(rows), skipped[0])
    if not examples:
        raise DataSourceError(f"data.source={config.source!r}: all {len(rows)} rows are bad, nothing to train on; "
                              f"the first: {'; '.join(skipped[:3])}")
    return examples, len(skipped)
