"""The project's shape (docs/architecture.md describes it): no import cycle between the package's modules, nor between the scripts of
``training/`` and ``benchmarks/`` (imports inside functions included); imports go one way (``models`` and
``data`` at the bottom, ``trainer`` on them, ``hub`` on top); no module or script past a size a newcomer reads
in one sitting; and no model class named in code by the trainer, the monitors, the export or the card (they go
through the method interface, ``ContrastivePreTrainedModel``)."""

import ast
from pathlib import Path

import pytest

import hf_contrast

PACKAGE = Path(hf_contrast.__file__).parent
ROOT = PACKAGE.parent
MAX_LINES = 350  # every module of the package
SCRIPT_MAX_LINES = {"training/pretrain.py": 400, "training/ablate.py": 350, "training/plan.py": 350}
TRAINING_MAX_LINES = 400  # any other script of training/ (transformers' example scripts: 400-480)
BENCHMARK_MAX_LINES = 450  # every file of benchmarks/ (gpu_check.py is split by section)
METHOD_CLASSES = {"MoCoModel", "MoCoV3Model", "SimCLRModel", "MoCoConfig", "MoCoV3Config", "SimCLRConfig"}
# (lower layer, what it must not import): imports go up from models and data to trainer, then hub
LAYERS = [("hf_contrast.models", "hf_contrast.data"), ("hf_contrast.models", "hf_contrast.trainer"),
          ("hf_contrast.models", "hf_contrast.hub"), ("hf_contrast.data", "hf_contrast.models"),
          ("hf_contrast.data", "hf_contrast.trainer"), ("hf_contrast.data", "hf_contrast.hub"),
          ("hf_contrast.trainer", "hf_contrast.hub")]


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (``module -> modules it imports``) as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, stack + [nxt])):
                return cycle
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name, [name])):
            return cycle
    return None


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def package_imports(name: str, path: Path, known: set[str], lazy: bool = True) -> set[str]:
    """Modules of the package that ``name`` imports: at module level, and with ``lazy`` inside functions too."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if lazy else tree.body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            candidates = submodules or [target]  # `from . import queue` imports the module, not the package
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        found |= {c for c in candidates if c in known and c != name}
    return found


def package_graph(lazy: bool = True) -> dict[str, set[str]]:
    mods = modules()
    # a package's __init__ re-exports its modules: an edge into a package is an edge into its __init__ only
    return {name: package_imports(name, path, set(mods), lazy) for name, path in mods.items()}


def script_imports(path: Path, known: set[str]) -> set[str]:
    """The scripts of ``training/`` and ``benchmarks/`` (by file stem, as they import each other through
    ``sys.path``) that the script at ``path`` imports, inside functions too."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level:
            found.add((node.module or "").split(".")[0])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
    return found & known - {path.stem}


def scripts() -> list[Path]:
    return sorted([*(ROOT / "training").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")])


def test_no_import_cycle_between_modules():
    graph = package_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle (inside functions included): " + " -> ".join(cycle)
    assert len(graph) > 20 and graph["hf_contrast.trainer.contrastive_trainer"]  # the walk saw real edges


def test_no_import_cycle_between_scripts():
    paths = scripts()
    stems = [p.stem for p in paths]
    assert len(stems) == len(set(stems)), "two scripts share a name: their imports would be ambiguous"
    graph = {p.stem: script_imports(p, set(stems)) for p in paths}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between scripts: " + " -> ".join(cycle)
    assert "gpu_check_common" in graph["gpu_e2e_raw"] and "gpu_e2e" in graph["gpu_check"]  # real edges seen


def test_imports_go_one_way_between_the_packages():
    graph = package_graph()
    wrong = sorted((name, target) for name, targets in graph.items() for low, high in LAYERS
                   if name == low or name.startswith(low + ".")
                   for target in targets if target == high or target.startswith(high + "."))
    assert not wrong, wrong
    # the trainer's push_to_hub reaches the Hub through the hook the package's __init__ sets, not an import
    assert hf_contrast.ContrastiveTrainer.encoder_push is hf_contrast.push_encoder_to_hub


def test_the_checks_see_a_planted_cycle_and_a_lazy_import(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    planted = tmp_path / "one.py"
    planted.write_text("import os\n\n\ndef f():\n    from two import g\n    import three.x\n")
    assert script_imports(planted, {"one", "two", "three", "four"}) == {"two", "three"}
    module = tmp_path / "mod.py"
    module.write_text("def f():\n    from .other import g\n")
    known = {"hf_contrast.data.mod", "hf_contrast.data.other"}
    assert package_imports("hf_contrast.data.mod", module, known) == {"hf_contrast.data.other"}
    assert package_imports("hf_contrast.data.mod", module, known, lazy=False) == set()


def test_no_module_is_too_long_to_read():
    long = {name: n for name, path in modules().items() if (n := lines(path)) > MAX_LINES}
    assert not long, long


def test_scripts_read_as_examples():
    limits = {p.relative_to(ROOT).as_posix(): SCRIPT_MAX_LINES.get(p.relative_to(ROOT).as_posix(), TRAINING_MAX_LINES)
              for p in (ROOT / "training").glob("*.py")}
    limits |= {p.relative_to(ROOT).as_posix(): BENCHMARK_MAX_LINES for p in (ROOT / "benchmarks").glob("*.py")}
    assert set(SCRIPT_MAX_LINES) <= set(limits)  # the named scripts exist
    long = {path: (n, limit) for path, limit in limits.items() if (n := lines(ROOT / path)) > limit}
    assert not long, long


@pytest.mark.parametrize("name", ["hf_contrast.trainer", "hf_contrast.hub.export", "hf_contrast.hub.model_card",
                                  "hf_contrast.hub.push"])
def test_trainer_monitors_export_and_card_name_no_method_class(name):
    paths = [p for n, p in modules().items() if n == name or n.startswith(name + ".")]
    assert paths
    for path in paths:
        tree = ast.parse(path.read_text())
        named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not named & METHOD_CLASSES, (path, named & METHOD_CLASSES)
        source = path.read_text()
        for flag in ("is_moco", "is_mocov3", "model_type =="):
            assert flag not in source, (path, flag)
