"""The field reference of docs/configuration.md, generated from jgrpo/config/sections.py: every field with its
type, default and the comments written beside it in the source. A test keeps the page equal to this output, so it
cannot go stale; regenerate after changing a config field:

    python -m jgrpo.config.docs          # rewrites the table between the markers of docs/configuration.md
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from pathlib import Path

from jgrpo.config import Config

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
BEGIN, END = "<!-- fields:begin -->", "<!-- fields:end -->"
_FIELD = re.compile(r"^    (\w+): (.+?)(?: = (.+?))?(?:\s+# (.*))?$")


def _type(annotation: str) -> str:
    literal = re.fullmatch(r"Literal\[(.*)\]", annotation)
    if literal:
        return " \\| ".join(v.strip().strip("\"'") for v in literal.group(1).split(","))
    listed = re.fullmatch(r"tuple\[(Literal\[.*\]), \.\.\.\]", annotation)
    if listed:
        return "list of " + _type(listed.group(1))
    return annotation.replace("|", "\\|")


def _default(value) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def section_fields(cls) -> list[tuple[str, str, str, str]]:
    """(name, type, default, description) of each field of a config dataclass, from its source."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    rows, comments = [], []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comments.append(stripped.lstrip("# ").strip())
            continue
        match = _FIELD.match(line)
        if match and match.group(1) in defaults:
            name, annotation, _, trailing = match.groups()
            text = " ".join(comments + ([trailing] if trailing else []))
            rows.append((name, _type(annotation), _default(defaults[name]), text.replace("|", "\\|")))
        comments = []
    return rows


def _rows(prefix: str, cls) -> list[str]:
    """Table rows of a section; a field that is itself a section (model.lora) lists its own fields."""
    nested = {f.name: type(f.default) for f in dataclasses.fields(cls) if dataclasses.is_dataclass(f.default)}
    lines = []
    for name, type_, default, text in section_fields(cls):
        if name in nested:
            lines += _rows(f"{prefix}.{name}", nested[name])
        else:
            lines.append(f"| `{prefix}.{name}` | {type_} | `{default}` | {text} |")
    return lines


def render() -> str:
    """The markdown table of every field of every section, in the order of jgrpo/config/sections.py."""
    lines = []
    for section in dataclasses.fields(Config):
        lines += [f"### `{section.name}`", "", "| field | values | default | meaning |", "|---|---|---|---|"]
        lines += _rows(section.name, section.default_factory)
        lines.append("")
    return "\n".join(lines)


def page_with_fields(page: str) -> str:
    """`page` with the text between the markers replaced by `render()`."""
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{render()}\n{END}{tail}"


def main() -> int:
    PAGE.write_text(page_with_fields(PAGE.read_text()))
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
