"""The import graph of `keras_fastloop/` runs in one direction and has no cycle.

The layers are read from `docs/design.md`, section "Layers" (written once, there). Every
import is read from the code with `ast` (inside functions and `if TYPE_CHECKING:` included),
so a deferred import cannot hide an upward arrow. No exceptions are listed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "keras_fastloop"


def _module_name(package_dir, path):
    parts = [package_dir.name, *path.relative_to(package_dir).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_of(package_dir):
    """`{module name: path}` of every `.py` file under `package_dir`."""
    package_dir = Path(package_dir)
    return {_module_name(package_dir, p): p for p in sorted(package_dir.rglob("*.py"))}


def import_graph(package_dir):
    """`{module: set of modules of the package it imports}`.

    `from P import N` imports `P.N` when that is a module of the package, else `P`;
    `import A.B` imports `A.B`. Relative imports are resolved.
    """
    modules = modules_of(package_dir)
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    deps.add(full if full in modules else base)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def layers_from_design(text):
    """The layers of `docs/design.md`'s "Layers" section: a list of lists of paths."""
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    layers = []
    for match in re.finditer(r"^\d+\. (.*?)(?=^\d+\. |^\s*$)", section, re.M | re.S):
        layers.append(re.findall(r"`([^`]+\.py|[^`]+/)`", match.group(1)))
    return layers


def layer_of(package_dir, layers):
    """`{module: layer index}`; a module in no layer or in two is an error."""
    package_dir = Path(package_dir)
    result, errors = {}, []
    for name, path in modules_of(package_dir).items():
        rel = path.relative_to(package_dir).as_posix()
        hits = {
            i
            for i, entries in enumerate(layers)
            for entry in entries
            if rel == entry or (entry.endswith("/") and rel.startswith(entry))
        }
        if len(hits) != 1:
            errors.append(f"{rel}: in layers {sorted(hits)} (must be in exactly one)")
        else:
            result[name] = hits.pop()
    return result, errors


def upward_imports(graph, layer):
    return sorted(
        f"{m} (layer {layer[m] + 1}) imports {d} (layer {layer[d] + 1})"
        for m, deps in graph.items()
        for d in deps
        if layer[d] > layer[m]
    )


def cycles(graph):
    """Strongly connected components with more than one module (Tarjan, 1972)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _check(package_dir, design_text):
    layers = layers_from_design(design_text)
    layer, errors = layer_of(package_dir, layers)
    graph = import_graph(package_dir)
    errors += upward_imports(graph, layer) if not errors else []
    errors += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return errors


def test_keras_fastloop_imports_run_down_the_layers_without_cycles():
    design = (ROOT / "docs" / "design.md").read_text()
    assert len(layers_from_design(design)) >= 5
    assert _check(ROOT / PACKAGE, design) == []


_FAKE_DESIGN = """# x

## Layers

1. `low.py`, `parts/`
2. `high.py`, `__init__.py`

## Next
"""


def _fake_package(tmp_path, files):
    package = tmp_path / "fakepkg"
    for rel, text in {"__init__.py": "", **files}.items():
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        (package / rel).write_text(text)
    return package


def test_the_check_passes_a_fake_package_whose_imports_run_down(tmp_path):
    package = _fake_package(
        tmp_path,
        {
            "low.py": "",
            "parts/__init__.py": "",
            "parts/a.py": "from fakepkg import low\n",
            "high.py": "from fakepkg.parts import a\nimport fakepkg.low\n",
        },
    )
    assert layers_from_design(_FAKE_DESIGN) == [["low.py", "parts/"], ["high.py", "__init__.py"]]
    assert import_graph(package)["fakepkg.high"] == {"fakepkg.parts.a", "fakepkg.low"}
    assert _check(package, _FAKE_DESIGN) == []


def test_the_check_fails_on_an_upward_import_inside_a_function(tmp_path):
    package = _fake_package(
        tmp_path,
        {
            "low.py": "",
            "parts/__init__.py": "",
            "parts/a.py": "def f():\n    from fakepkg.high import thing\n    return thing\n",
            "high.py": "thing = 1\n",
        },
    )
    assert _check(package, _FAKE_DESIGN) == [
        "fakepkg.parts.a (layer 1) imports fakepkg.high (layer 2)"
    ]


def test_the_check_fails_on_a_relative_upward_import(tmp_path):
    package = _fake_package(
        tmp_path, {"low.py": "from . import high\n", "parts/__init__.py": "", "high.py": ""}
    )
    assert _check(package, _FAKE_DESIGN) == ["fakepkg.low (layer 1) imports fakepkg.high (layer 2)"]


def test_the_check_fails_on_a_cycle_inside_one_layer(tmp_path):
    package = _fake_package(
        tmp_path,
        {
            "low.py": "from fakepkg.parts import a\n",
            "parts/__init__.py": "",
            "parts/a.py": "import fakepkg.parts.b\n",
            "parts/b.py": "from fakepkg import low\n",
            "high.py": "",
        },
    )
    assert _check(package, _FAKE_DESIGN) == [
        "import cycle: fakepkg.low -> fakepkg.parts.a -> fakepkg.parts.b"
    ]


def test_the_check_fails_on_a_module_in_no_layer(tmp_path):
    package = _fake_package(tmp_path, {"low.py": "", "high.py": "", "extra.py": ""})
    assert _check(package, _FAKE_DESIGN) == ["extra.py: in layers [] (must be in exactly one)"]


def test_cycles_finds_a_synthetic_cycle_and_none_in_a_tree():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


LONG_FILE_REASON = "# Over 500 lines on purpose:"


def long_files_without_reason(package_dir, limit=500):
    """The package's `.py` files over `limit` lines whose first line gives no reason."""
    found = []
    for path in sorted(Path(package_dir).rglob("*.py")):
        lines = path.read_text().splitlines()
        if len(lines) > limit and not lines[0].startswith(LONG_FILE_REASON):
            found.append(f"{path.relative_to(package_dir)} ({len(lines)} lines)")
    return found


def test_no_file_of_the_package_is_over_500_lines_without_a_reason_at_its_top():
    assert long_files_without_reason(ROOT / PACKAGE) == []


def test_the_long_file_check_finds_a_long_file_and_accepts_its_reason(tmp_path):
    (tmp_path / "short.py").write_text("x = 1\n" * 10)
    (tmp_path / "long.py").write_text("x = 1\n" * 501)
    assert long_files_without_reason(tmp_path) == ["long.py (501 lines)"]
    (tmp_path / "long.py").write_text(f"{LONG_FILE_REASON} one table.\n" + "x = 1\n" * 501)
    assert long_files_without_reason(tmp_path) == []


def test_the_step_package_holds_traced_code_only():
    """`_step/` runs inside the trace; callbacks and eager reads live on the fit side
    (`_fit_callbacks.py`)."""
    for path in sorted((ROOT / PACKAGE / "_step").glob("*.py")):
        text = path.read_text()
        assert "callbacks.Callback" not in text, path.name
        assert ".numpy()" not in text, path.name


def test_the_library_never_imports_its_benchmark():
    """`keras_fastloop_bench` is a sibling package: it imports the library, never the reverse."""
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.startswith("keras_fastloop_bench") for n in names), path
