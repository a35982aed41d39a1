"""How wide the package's interfaces are: `python scripts/interface_sizes.py [--rev REV]`.

Two counts, read from the source with `ast` (nothing is imported), in rl/, training/ and models/ (ROOMS):
  - the parameters of every public function (module functions and the methods of public classes, `__init__`
    included; `self` / `cls` not counted, `*args` and `**kwargs` one each), over LIMITS' `parameters`. A function is
    public when neither it, its class nor its module starts with `_` (dunders are public);
  - the attributes of every class that has methods other than properties: the names its methods assign on `self`
    (and a dataclass's fields), over LIMITS' `attributes`. NamedTuples, and dataclasses whose only methods are
    properties (and `__post_init__`'s checks), are records (one value of many fields) and are not counted.
A function that needs more inputs than the limit is asking for a record (a NamedTuple passed whole) or an object;
a class that holds more attributes is two classes (the design notes). Classes of the other rooms are listed, not
held to the limit.

It prints every function and class over its limit, then one JSON line with the totals;
tests/test_interface_sizes.py runs it and expects none over in ROOMS. `--rev REV` counts a commit's package instead
of this checkout's (the before of a change), read from git without checking it out.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jgrpo"
ROOMS = ("rl", "training", "models")
LIMITS = {"parameters": 8, "attributes": 15}


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> int:
    a = node.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x is not None)]
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
    return len(names) - (1 if method and not static and names else 0)


def _is_property(node) -> bool:
    return any((isinstance(d, ast.Name) and d.id in ("property", "cached_property"))
               or (isinstance(d, ast.Attribute) and d.attr in ("setter", "getter", "cached_property"))
               for d in node.decorator_list)


def _is_record(node: ast.ClassDef) -> bool:
    """A NamedTuple, or a dataclass whose methods are all properties (or the checks of `__post_init__`)."""
    bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
    dataclass = any("dataclass" in ast.unparse(d) for d in node.decorator_list)
    methods = [n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    if "NamedTuple" in bases:
        return True
    return dataclass and all(_is_property(m) or m.name == "__post_init__" for m in methods)


def _attributes(node: ast.ClassDef) -> set[str]:
    names = set()
    if any("dataclass" in ast.unparse(d) for d in node.decorator_list):
        names |= {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                  and "ClassVar" not in ast.unparse(s.annotation)}
    for method in (n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
        for sub in ast.walk(method):
            targets = sub.targets if isinstance(sub, ast.Assign) else [getattr(sub, "target", None)]
            for target in targets:
                for leaf in ast.walk(target) if target is not None else ():
                    if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                            and leaf.value.id == "self" and isinstance(leaf.ctx, ast.Store)):
                        names.add(leaf.attr)
    return names


def measure(package: Path = PACKAGE) -> dict:
    """{"functions": {name: parameters}, "classes": {name: attributes}} of every counted function and class of
    `package` (a class of another room than ROOMS is named with a leading "other:")."""
    functions, classes = {}, {}
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package.parent).as_posix()
        tree = ast.parse(path.read_text())
        room = path.relative_to(package).parts[0]
        counted_room = room in ROOMS and not path.stem.startswith("_")
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and counted_room:
                if not node.name.startswith("_"):
                    functions[f"{relative}::{node.name}"] = _parameters(node, method=False)
            elif isinstance(node, ast.ClassDef):
                if not _is_record(node):
                    classes[f"{'' if room in ROOMS else 'other:'}{relative}::{node.name}"] = len(_attributes(node))
                if not counted_room or node.name.startswith("_"):
                    continue
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef) and (
                            not sub.name.startswith("_") or sub.name.startswith("__")):
                        functions[f"{relative}::{node.name}.{sub.name}"] = _parameters(sub, method=True)
    return {"functions": functions, "classes": classes}


def over_limits(sizes: dict, other_rooms: bool = False) -> dict:
    """The functions and classes of `measure` over LIMITS (the classes of other rooms only with `other_rooms`)."""
    return {"functions": {k: v for k, v in sizes["functions"].items() if v > LIMITS["parameters"]},
            "classes": {k: v for k, v in sizes["classes"].items()
                        if v > LIMITS["attributes"] and (other_rooms or not k.startswith("other:"))}}


def _measure_rev(rev: str) -> dict:
    """`measure` of the package as commit `rev` holds it (unpacked from `git archive` into a scratch folder)."""
    archive = subprocess.run(["git", "archive", "--format=tar", rev, "jgrpo"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        return measure(Path(tmp) / "jgrpo")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", help="count this git revision's package (e.g. main, HEAD~3) instead")
    args = parser.parse_args(argv)
    sizes = _measure_rev(args.rev) if args.rev else measure()
    over, everywhere = over_limits(sizes), over_limits(sizes, other_rooms=True)
    print(f"public functions in {', '.join(ROOMS)} with more than {LIMITS['parameters']} parameters:")
    for name, count in sorted(over["functions"].items(), key=lambda kv: -kv[1]):
        print(f"  {count:3d}  {name}")
    print(f"classes with methods holding more than {LIMITS['attributes']} attributes (other: another room's):")
    for name, count in sorted(everywhere["classes"].items(), key=lambda kv: -kv[1]):
        print(f"  {count:3d}  {name}")
    in_rooms = {k: v for k, v in sizes["classes"].items() if not k.startswith("other:")}
    print(json.dumps({"functions": len(sizes["functions"]), "functions_over": len(over["functions"]),
                      "most_parameters": max(sizes["functions"].values()), "classes": len(in_rooms),
                      "classes_over": len(over["classes"]), "most_attributes": max(in_rooms.values()),
                      "other_rooms_classes_over": len(everywhere["classes"]) - len(over["classes"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
