"""The package's shape: no import cycles, no reaching into other modules' private names, and one owner for
each piece that used to exist in several copies (one-line copies `duplicates` cannot see).

Imports are read from the source with `ast`, function-level (lazy) imports included: a lazy import is still
an import, and a cycle through one is still a knot a reader has to untie.
"""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jgrpo"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


MODULES = _modules()


def _owning_module(dotted: str) -> str:
    while dotted not in MODULES:
        dotted = dotted.rsplit(".", 1)[0]
    return dotted


def _imports(name: str, path: Path) -> list[tuple[str, str | None]]:
    """(imported module, imported name or None) for every jgrpo import anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(_owning_module(a.name), None) for a in node.names if a.name.split(".")[0] == "jgrpo"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(parts + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "jgrpo":
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                found.append((full, None) if full in MODULES else (_owning_module(source), alias.name))
    return found


def _graph() -> dict[str, set[str]]:
    return {name: {target for target, _ in _imports(name, path)} - {name} for name, path in MODULES.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_import_graph_has_no_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_can_fail():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    # The entrypoints used to form one: eval imported train's set-up, the trainer imported eval's Evaluator.
    assert _cycle({"jgrpo.train": {"jgrpo.trainer"}, "jgrpo.trainer": {"jgrpo.eval"},
                   "jgrpo.eval": {"jgrpo.train"}}) is not None


def test_no_module_imports_another_modules_private_names():
    private = [f"{name} imports {source}.{imported}" for name, path in MODULES.items()
               for source, imported in _imports(name, path)
               if imported and imported.startswith("_") and source != name]
    assert not private, private


def test_entrypoints_are_not_imported_by_the_library():
    entrypoints = {"jgrpo.train", "jgrpo.eval", "jgrpo.export", "jgrpo.sample", "jgrpo.plan", "jgrpo.plot"}
    offenders = [f"{name} -> {target}" for name, targets in _graph().items() for target in targets
                 if target in entrypoints and name not in entrypoints | {"jgrpo.config_docs"}]
    assert not offenders, offenders


# (piece, its owner, a pattern only the owner's source may contain)
OWNERS = [
    ("pad id fallback", "jgrpo.data.prompts", r"\.pad_token_id\b"),
    ("chat template", "jgrpo.data.prompts", r"apply_chat_template|\.chat_template\b"),
    ("left padding", "jgrpo.data.prompts", r"width - len\(|def \w*left_pad\w*\("),
    ("bucketing", "jgrpo.data.prompts", r"ceil\([^)]*bucket|//\s*bucket"),
    ("metric reduction by suffix", "jgrpo.diagnostics", r"""endswith\(\s*(["']_(min|max)|"_" \+)"""),
    ("param copy", "jgrpo.mesh", r"(jnp|jax\.numpy)\.copy\b"),
    ("replicated key", "jgrpo.mesh", r"lambda: jax\.random\.key\("),
    ("decode and score completions", "jgrpo.rollout", r"\.batch_decode\(|\bscorer\.score\("),
]


@pytest.mark.parametrize("piece,owner,pattern", OWNERS, ids=[o[0] for o in OWNERS])
def test_each_piece_has_one_owner(piece, owner, pattern):
    holders = sorted(name for name, path in MODULES.items() if re.search(pattern, path.read_text()))
    assert holders == [owner], f"{piece}: expected only {owner}, found in {holders}"


def _rows_over_batch_axes(node) -> bool:
    """A logical-axes tuple that names only "batch" (the rest None): the rows-over-the-batch-axes layout."""
    if not isinstance(node, ast.Tuple):
        return False
    values = [e.value if isinstance(e, ast.Constant) else ... for e in node.elts]
    return "batch" in values and all(v in ("batch", None) for v in values)


def test_rows_over_the_batch_axes_have_one_owner():
    holders = sorted(name for name, path in MODULES.items()
                     if any(_rows_over_batch_axes(n) for n in ast.walk(ast.parse(path.read_text())))
                     or re.search(r'\[\w+\] = "batch"', path.read_text()))
    assert holders == ["jgrpo.mesh"], holders
