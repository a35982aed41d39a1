"""The README reads in one sitting and links every document; every relative link resolves; nothing cites a
document outside the repository; every file path and dotted `jgrpo.x.y` name the docs and the code's docstrings and
comments cite exists."""

import ast
import importlib
import io
import re
import tokenize
import warnings
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


DOTTED_NAME = re.compile(r"(?<![\w./-])jgrpo(?:\.[A-Za-z_]\w*)+")
# Dotted names the docs write that are not the package's, each with why.
NOT_NAMES = {
    "jgrpo.X": "a placeholder: `python -m jgrpo.X`, any entrypoint",
    "jgrpo.x.y": "a placeholder: docs/testing.md says what form of name this check reads",
    "jgrpo.sampling_policy.SamplingPolicy": "docs/architecture.md's old import paths: a class replaced, not moved",
}


def _resolves(dotted: str) -> bool:
    """Whether `dotted` names a module of the package, or an attribute of one (old paths import, with a warning)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                found = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attribute in parts[i:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def _prose(path: Path) -> list[str]:
    """A page's text, or a source file's comments and docstrings (its code is checked by running it)."""
    if path.suffix == ".md":
        return [path.read_text()]
    source = path.read_text()
    comments = [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
    nodes = (n for n in ast.walk(ast.parse(source))
             if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef))
    return comments + [doc for n in nodes if (doc := ast.get_docstring(n, clean=False))]


def test_every_dotted_name_resolves():
    """`jgrpo.x.y` names in the docs, the README and every source file's comments and docstrings."""
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    sources = [p for p in ROOT.rglob("*.py")
               if not {".git", "runs", "wheels", "results"} & set(p.relative_to(ROOT).parts) and p != Path(__file__)]
    cited: dict[str, set[str]] = {}
    for path in pages + sources:
        for text in _prose(path):
            for m in DOTTED_NAME.finditer(text):
                cited.setdefault(m.group(0), set()).add(path.relative_to(ROOT).as_posix())
    assert _resolves("jgrpo.rl.objectives.grpo_loss") and _resolves("jgrpo.trainer")  # (an old path)
    assert not _resolves("jgrpo.rl.objectives.no_such_loss") and not _resolves("jgrpo.no_such_room.module")
    assert DOTTED_NAME.findall("see `jgrpo.models.llm`, jgrpo/models and x.jgrpo.y.") == ["jgrpo.models.llm"]
    assert len(cited) > 50
    missing = sorted(f"{name} ({', '.join(sorted(where))})" for name, where in cited.items()
                     if name not in NOT_NAMES and not _resolves(name))
    assert missing == [], missing
