"""The modules of ``moe_fp8`` import each other without cycles (``tools/import_graph.py``), and the
checker finds the cycles of synthetic packages: relative and absolute imports, at module level and
inside functions, ``from pkg import submodule``, self imports; ``TYPE_CHECKING`` imports left out."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load_import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


import_graph = _load_import_graph()


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    """A package ``pkg`` under ``tmp_path`` with ``files`` (relative path -> source); returns its folder."""
    for name, source in {"__init__.py": "", **files}.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return tmp_path / "pkg"


def _edges(package: Path) -> set[tuple[str, str]]:
    return {(imp.source, imp.target) for imp in import_graph.imports(package)}


def _cycles(package: Path) -> list[set[str]]:
    return [{imp.source for imp in cycle} for cycle in import_graph.cycles(import_graph.imports(package))]


def test_moe_fp8_has_no_import_cycles():
    found = import_graph.imports(ROOT / "moe_fp8")
    assert len(found) > 100  # the graph was read
    cycles = import_graph.cycles(found)
    assert not cycles, "import cycles among moe_fp8's modules:\n" + "\n".join(map(import_graph.format_cycle, cycles))


def test_layers_do_not_import_parallel():
    reach = [imp for imp in import_graph.imports(ROOT / "moe_fp8")
             if imp.source.startswith("moe_fp8.layers") and imp.target.startswith("moe_fp8.parallel")]
    assert not reach, "\n".join(map(str, reach))


def test_a_pair_importing_each_other_inside_a_function(tmp_path):
    package = _package(tmp_path, {
        "a.py": "from .b import g\n\ndef f():\n    return g()\n",
        "b.py": "def g():\n    from pkg.a import f\n    return f\n",
        "c.py": "from . import a\n",
    })
    cycles = import_graph.cycles(import_graph.imports(package))
    assert [{imp.source for imp in cycle} for cycle in cycles] == [{"pkg.a", "pkg.b"}]
    text = import_graph.format_cycle(cycles[0])
    assert "pkg.a -> pkg.b" in text and "a.py:1: from .b import g" in text
    assert "pkg.b -> pkg.a" in text and "b.py:2: from pkg.a import f" in text


def test_a_longer_cycle_through_a_package_init(tmp_path):
    package = _package(tmp_path, {
        "low/__init__.py": "from .core import thing\n",
        "low/core.py": "import pkg.high.user\nthing = 1\n",
        "high/__init__.py": "",
        "high/user.py": "from ..low import thing\n",
    })
    assert ("pkg.high.user", "pkg.low") in _edges(package)
    assert _cycles(package) == [{"pkg.low", "pkg.low.core", "pkg.high.user"}]


def test_a_module_importing_itself(tmp_path):
    package = _package(tmp_path, {"a.py": "def f():\n    from . import a\n"})
    assert _cycles(package) == [{"pkg.a"}]


def test_submodules_type_checking_and_parents(tmp_path):
    package = _package(tmp_path, {
        "__init__.py": "from .sub import x\n",
        "sub/__init__.py": "from .leaf import x\nfrom . import leaf\n",
        "sub/leaf.py": "from typing import TYPE_CHECKING\nimport os\nif TYPE_CHECKING:\n    from pkg import sub\n"
                       "else:\n    from .. import other\nx = 1\n",
        "other.py": "from .sub import leaf as module\n",
        "user.py": "from pkg.sub import x\n",
    })
    assert _edges(package) == {
        ("pkg", "pkg.sub"),
        ("pkg.sub", "pkg.sub.leaf"),  # twice: `from .leaf import x`, `from . import leaf`
        ("pkg.sub.leaf", "pkg.other"),  # the else branch runs; the TYPE_CHECKING one does not
        ("pkg.other", "pkg.sub.leaf"),  # the submodule
        ("pkg.user", "pkg.sub"),  # x, from the package's __init__
    }
    # no cycle through pkg.sub: the TYPE_CHECKING import and the implicit parent imports are left out
    assert _cycles(package) == [{"pkg.other", "pkg.sub.leaf"}]


def test_command_line_prints_imports_and_cycles(tmp_path):
    package = _package(tmp_path, {"a.py": "from . import b\n", "b.py": "from .a import f\n"})
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "import_graph.py"), str(package)],
                         capture_output=True, text=True)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "pkg.a -> pkg.b" in run.stdout and "1 cycle(s)" in run.stdout and "cycle among pkg.a, pkg.b" in run.stdout
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "import_graph.py")], capture_output=True, text=True)
    assert run.returncode == 0 and "0 cycle(s)" in run.stdout, run.stdout + run.stderr
