"""The package's shape: no import cycle between its modules, no module past a size a newcomer reads in one
sitting, and no model class named in code by the trainer, the monitors, the export or the card (they go
through the method interface, ``ContrastivePreTrainedModel``)."""

import ast
from pathlib import Path

import pytest

import hf_contrast

PACKAGE = Path(hf_contrast.__file__).parent
MAX_LINES = 500  # README "Architecture" lists the modules over 300
METHOD_CLASSES = {"MoCoModel", "MoCoV3Model", "SimCLRModel", "MoCoConfig", "MoCoV3Config", "SimCLRConfig"}


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def import_time_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that ``name`` imports when it is imported (module level, not inside functions)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
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


def test_no_import_cycle_between_modules():
    mods = modules()
    graph = {name: import_time_imports(name, path, set(mods)) for name, path in mods.items()}
    # a package's __init__ re-exports its modules: an edge into a package is an edge into its __init__ only
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert len(graph) > 20 and graph["hf_contrast.trainer.contrastive_trainer"]  # the walk saw real edges


def test_no_module_is_too_long_to_read():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
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
