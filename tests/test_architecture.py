"""The package's shape: no import cycles, no reaching into other modules' private names, and one owner for
each piece that used to exist in several copies (one-line copies `duplicates` cannot see).

Imports are read from the source with `ast`, function-level (lazy) imports included: a lazy import is still
an import, and a cycle through one is still a knot a reader has to untie.
"""

import ast
import os
import re
import subprocess
import sys
import textwrap
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
    assert _cycle({"jgrpo.train": {"jgrpo.training.trainer"}, "jgrpo.training.trainer": {"jgrpo.eval"},
                   "jgrpo.eval": {"jgrpo.train"}}) is not None


def test_no_module_imports_another_modules_private_names():
    private = [f"{name} imports {source}.{imported}" for name, path in MODULES.items()
               for source, imported in _imports(name, path)
               if imported and imported.startswith("_") and source != name]
    assert not private, private


ENTRYPOINTS = {"jgrpo.train", "jgrpo.eval", "jgrpo.export", "jgrpo.sample", "jgrpo.plan", "jgrpo.plot"}
# The rooms, bottom up (docs/architecture.md): a module imports only rooms of a lower level, or its own room.
LEVELS = {
    "jgrpo": 0,  # the package itself: the platform guard and the old-path finder (jgrpo._moved)
    "jgrpo.config": 1,
    "jgrpo.parallel": 2,
    "jgrpo.models": 3, "jgrpo.data": 3, "jgrpo.rewards": 3,
    "jgrpo.sampling": 4, "jgrpo.rl": 4, "jgrpo.envs": 4,
    "jgrpo.rollout": 5,
    "jgrpo.training": 6,
    "jgrpo.planning": 7,
    **dict.fromkeys(ENTRYPOINTS, 8),
}
# Rooms of one level that may import each other, one way, and why.
SAME_LEVEL = {("jgrpo.data", "jgrpo.rewards"): "the countdown task is generated with the countdown reward's checker"}


def _room(module: str) -> str:
    if module in ENTRYPOINTS or module == "jgrpo":
        return module
    parts = module.split(".")
    return "jgrpo" if parts[1].startswith("_") else ".".join(parts[:2])


def _layering_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for name, targets in graph.items():
        for target in targets:
            a, b = _room(name), _room(target)
            if a == b or LEVELS[b] < LEVELS[a] or (a, b) in SAME_LEVEL:
                continue
            found.append(f"{name} (level {LEVELS[a]}) imports {target} (level {LEVELS[b]})")
    return sorted(found)


def test_every_module_belongs_to_a_room_of_the_table():
    assert sorted({_room(m) for m in MODULES} - set(LEVELS)) == []
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12 and set(top) >= {"__init__.py", "train.py", "eval.py", "plot.py"}, top


def test_imports_run_one_way_down_the_rooms():
    violations = _layering_violations(_graph())
    assert not violations, violations


def test_the_layering_check_can_fail():
    inverted = {"jgrpo.config.sections": {"jgrpo.training.trainer"}, "jgrpo.rl.objectives": {"jgrpo.sampling.methods"},
                "jgrpo.rewards.scorer": {"jgrpo.data.pipeline"}, "jgrpo.models.llm": {"jgrpo.train"}}
    assert _layering_violations(inverted) == [
        "jgrpo.config.sections (level 1) imports jgrpo.training.trainer (level 6)",
        "jgrpo.models.llm (level 3) imports jgrpo.train (level 8)",
        "jgrpo.rewards.scorer (level 3) imports jgrpo.data.pipeline (level 3)",  # the allowed pair runs one way
        "jgrpo.rl.objectives (level 4) imports jgrpo.sampling.methods (level 4)",
    ]
    assert _layering_violations({"jgrpo.data.tasks": {"jgrpo.rewards.countdown"}}) == []


# (piece, its owner, a pattern only the owner's source may contain)
OWNERS = [
    ("pad id fallback", "jgrpo.data.prompts", r"\.pad_token_id\b"),
    ("chat template", "jgrpo.data.prompts", r"apply_chat_template|\.chat_template\b"),
    ("left padding", "jgrpo.data.prompts", r"width - len\(|def \w*left_pad\w*\("),
    ("bucketing", "jgrpo.data.prompts", r"ceil\([^)]*bucket|//\s*bucket"),
    ("metric reduction by suffix", "jgrpo.rl.diagnostics", r"""endswith\(\s*(["']_(min|max)|"_" \+)"""),
    ("param copy", "jgrpo.parallel.weights.copies", r"(jnp|jax\.numpy)\.copy\b"),
    ("replicated key", "jgrpo.parallel.mesh", r"lambda: jax\.random\.key\("),
    ("decode and score completions", "jgrpo.rollout.scoring", r"\.batch_decode\(|\bscorer\.score\("),
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
    assert holders == ["jgrpo.parallel.mesh"], holders


def test_importing_every_module_leaves_the_environment_alone():
    """Only jgrpo/__init__'s platform guard may touch os.environ, and not where JAX_PLATFORMS is set already: the
    planner used to set JAX_PLATFORMS=cpu when imported, which made jax CPU-only on a TPU VM."""
    code = textwrap.dedent("""
        import importlib, os, pkgutil
        # The libraries set variables of their own when imported (jax's TPU set-up, TensorFlow's log level):
        # imported first, so that what changes below is jgrpo's doing.
        for library in ("jax", "jax.experimental.topologies", "flax.nnx", "optax", "orbax.checkpoint", "grain",
                        "transformers", "pyarrow.parquet", "tensorboardX", "matplotlib.pyplot", "numpy"):
            importlib.import_module(library)
        before = dict(os.environ)
        import jgrpo
        for module in pkgutil.walk_packages(jgrpo.__path__, "jgrpo."):
            importlib.import_module(module.name)
        changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
        print("changed:", changed)
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env = {k: v for k, v in env.items() if not k.startswith("TPU_") and k != "ALLOW_MULTIPLE_LIBTPU_LOAD"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "changed: []"


def test_the_old_module_paths_still_work_and_warn_once():
    code = textwrap.dedent("""
        import warnings
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as caught:
            import jgrpo.trainer, jgrpo.training.trainer
            from jgrpo.sampler import generate
            from jgrpo.rollout import sample_and_score
            from jgrpo.planning import plan_iteration
            import jgrpo.trainer as again
            from jgrpo.rollout import sample_and_score as again_too
        import jgrpo.rollout.scoring, jgrpo.sampling.sampler, jgrpo.planning.fit
        assert jgrpo.trainer is jgrpo.training.trainer and again is jgrpo.training.trainer
        assert jgrpo.trainer.__spec__.name == "jgrpo.training.trainer"
        assert generate is jgrpo.sampling.sampler.generate and plan_iteration is jgrpo.planning.fit.plan_iteration
        assert sample_and_score is jgrpo.rollout.scoring.sample_and_score
        for w in caught:
            print(w.category.__name__, w.message)
    """)
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "JAX_PLATFORMS": "cpu"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "FutureWarning jgrpo.trainer moved to jgrpo.training.trainer; the old path goes in the next release "
        "(docs/architecture.md)",
        "FutureWarning jgrpo.sampler moved to jgrpo.sampling.sampler; the old path goes in the next release "
        "(docs/architecture.md)",
        "FutureWarning jgrpo.rollout.sample_and_score moved to jgrpo.rollout.scoring.sample_and_score; the old path "
        "goes in the next release (docs/architecture.md)",
        "FutureWarning jgrpo.planning.plan_iteration moved to jgrpo.planning.fit.plan_iteration; the old path goes "
        "in the next release (docs/architecture.md)",
    ]
    with pytest.raises(ModuleNotFoundError):
        __import__("jgrpo.no_such_module")


def test_every_old_path_names_a_module_that_exists():
    from jgrpo._moved import MOVED

    missing = [f"jgrpo.{old} -> jgrpo.{new}" for old, new in MOVED.items() if f"jgrpo.{new}" not in MODULES]
    clashing = [f"jgrpo.{old}" for old in MOVED if f"jgrpo.{old}" in MODULES]  # an old name may not come back
    assert not missing and not clashing, (missing, clashing)
