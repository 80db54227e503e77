"""attnhub's import graph flows one way: the runtime never imports tooling, and the
runtime's modules form layers, each importing only those below it."""

from __future__ import annotations

import ast
from pathlib import Path

import attnhub

PACKAGE = Path(attnhub.__file__).resolve().parent

# Bottom to top. A module may import modules of its own layer's predecessors only
# (and, within one layer, none of its peers).
RUNTIME_LAYERS: tuple[frozenset[str], ...] = (
    frozenset(
        {
            "errors",
            "env",
            "request",
            "call_stats",
            "jsonfile",
            "hookspecs",
            "tensor_memo",
            "tensor_guards",
            "eager",
            "timing",
            "mkl_vml",
            "argcheck",
            "mask_values",
        }
    ),
    frozenset({"backend", "block_sparse", "mask_rows"}),
    frozenset({"registry", "mask_structure"}),
    frozenset({"ranking", "output_check"}),
    frozenset({"cost_model"}),
    frozenset({"cost_table"}),
    frozenset({"measured"}),
    frozenset({"dispatch", "validation"}),
    frozenset({"autotune", "serving_validation"}),
    frozenset({"api", "serving"}),
    frozenset({"patching", "integrations.transformers", "distributed", "paged_cache"}),
)
TOOLING = frozenset({"bench", "bench_report", "bench_workloads", "bench_models", "bench_decode", "bench_serving", "tune", "demo", "cli", "__main__"})  # fmt: skip


def _imports(path: Path, module: str) -> set[str]:
    """attnhub modules that ``path`` imports anywhere (module level or inside functions)."""
    found: set[str] = set()
    package = module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for inner in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue  # annotations only: no import at run time
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x / from .x import y / from ..x import y
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join([*base, node.module]) if node.module else ".".join(base)
                names = [target] if node.module else []
                names += [
                    ".".join(filter(None, [target, a.name])) for a in node.names if not node.module
                ]
            elif node.module and node.module.startswith("attnhub."):
                names = [node.module.removeprefix("attnhub.")]
            else:
                continue
            found.update(n for n in names if n)
        elif isinstance(node, ast.Import):
            found.update(
                a.name.removeprefix("attnhub.") for a in node.names if a.name.startswith("attnhub.")
            )
    return found


def _modules() -> dict[str, Path]:
    return {
        ".".join(p.relative_to(PACKAGE).with_suffix("").parts): p
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py"
        and "testing" not in p.relative_to(PACKAGE).parts
        and "backends" not in p.relative_to(PACKAGE).parts
    }


def _layer(module: str) -> int | None:
    return next((i for i, layer in enumerate(RUNTIME_LAYERS) if module in layer), None)


def test_every_module_is_placed():
    placed = set().union(*RUNTIME_LAYERS) | TOOLING
    assert set(_modules()) <= placed, sorted(set(_modules()) - placed)


def test_the_runtime_imports_only_layers_below_it_and_never_tooling():
    wrong = []
    for module, path in _modules().items():
        layer = _layer(module)
        if layer is None:
            continue  # tooling may import anything
        for target in _imports(path, module):
            target_layer = _layer(target)
            if target in TOOLING or (target_layer is not None and target_layer >= layer):
                wrong.append(f"{module} (layer {layer}) imports {target} (layer {target_layer})")
    assert not wrong, "\n".join(wrong)
