"""The README reads in one sitting and links every document; every relative link resolves; nothing cites a
document outside the repository."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _links(page: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(page.read_text()) if "://" not in m.group(1)]


def test_readme_is_short_and_links_every_doc():
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 250
    linked = {(ROOT / target).resolve() for target in _links(readme)}
    assert [d.name for d in DOCS if d.resolve() not in linked] == []


def test_every_relative_link_resolves():
    broken = [f"{page.name}: {target}" for page in [ROOT / "README.md", *DOCS] for target in _links(page)
              if not (page.parent / target).exists()]
    assert broken == []


def test_nothing_cites_a_document_outside_the_repository():
    files = [p for pattern in ("*.py", "*.md", "*.yaml", "*.sh") for p in ROOT.rglob(pattern)
             if not {".git", "runs", "wheels"} & set(p.relative_to(ROOT).parts) and p != Path(__file__)]
    citing = [str(p.relative_to(ROOT)) for p in files if re.search(r"GRPO_SPEC|\.\./shared", p.read_text())]
    assert citing == [], citing


CITED_PATH = re.compile(r"(?<![\w./~-])((?:jgrpo|tests)/(?:\w+/)*(?:\w+\.py|))(?![\w/])")


def test_every_cited_path_exists():
    """`jgrpo/...` and `tests/...` file and folder paths in the docs, the README and every source file (comments,
    docstrings)."""
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    sources = [p for pattern in ("*.py", "*.sh", "*.yaml") for p in ROOT.rglob(pattern)
               if not {".git", "runs", "wheels", "results"} & set(p.relative_to(ROOT).parts) and p != Path(__file__)]
    cited = {(p.relative_to(ROOT).as_posix(), m.group(1)) for p in pages + sources
             for m in CITED_PATH.finditer(p.read_text())}
    example = "`jgrpo/trainer.py`, jgrpo/rl/ and ~/.cache/jgrpo/xla"
    assert CITED_PATH.findall(example) == ["jgrpo/trainer.py", "jgrpo/rl/"]
    assert len(cited) > 30
    missing = sorted(f"{where}: {path}" for where, path in cited if not (ROOT / path).exists())
    assert missing == [], missing
