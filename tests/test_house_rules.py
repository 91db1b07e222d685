"""The rules of the house that no other test sees: private API in one module, one vocabulary, short files,
imports that flow down the floors without a circle.

Each rule reads the package's source as text, so a new file that breaks one fails here by name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_memopt"
SOURCES = sorted(PACKAGE.rglob("*.py"))
# what a file past this many lines must say in its docstring ("Over 500 lines because …")
MOST_LINES = 500

# private torch / Lightning API: only lightning_memopt/private_api.py may use it
PRIVATE_USES = {
    "a private torch module": re.compile(r"\btorch(\.\w+)*\._[a-z]\w*"),
    "a private name imported from torch or Lightning": re.compile(
        r"from (torch|lightning)(\.\w+)* import .*\b_[a-z]\w*"
    ),
    "a private attribute of a Lightning object": re.compile(
        r"\._(trainer|results|data_source|batches_that_stepped|should_accumulate|accelerator_connector)\b"
    ),
    "a private attribute read by name": re.compile(r"getattr\([^,]+,\s*['\"]_[a-z]\w*"),
    "torch's private batch-norm base": re.compile(r"\b_BatchNorm\b"),
    "a tensor's private base": re.compile(r"\._base\b"),
}
# the vocabulary declared once: only lightning_memopt/vocabulary.py may spell these out
VOCABULARY = {
    "a unit": re.compile(r"^\s*_?[A-Z]*I?B\s*=\s*(2\s*\*\*\s*(20|30)|1e9)\b", re.MULTILINE),
    "the precisions": re.compile(r"\(\s*\"32-true\",\s*\"bf16-mixed\",\s*\"16-mixed\""),
    "the checkpoint modes": re.compile(r"\(\s*\"full\",\s*\"selective\",\s*\"offload\"\s*\)"),
    "the attention kernels": re.compile(r"\(\s*\"sdpa\",\s*\"math\"\s*\)"),
}


def _relative(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


def _code(path: Path) -> str:
    """The source without its comments and docstrings (which may name what they explain)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            first.value.value = ""
    return ast.unparse(tree)


@pytest.mark.parametrize("path", [p for p in SOURCES if p.name != "private_api.py"], ids=_relative)
def test_private_api_is_used_only_through_the_adapter_module(path):
    code = _code(path)
    found = [f"{what}: {match.group(0)!r}" for what, rule in PRIVATE_USES.items() for match in rule.finditer(code)]
    assert not found, f"{_relative(path)} uses {found}; add it to lightning_memopt/private_api.py and call it there"


@pytest.mark.parametrize("path", [p for p in SOURCES if p.name != "vocabulary.py"], ids=_relative)
def test_the_vocabulary_is_declared_once(path):
    code = _code(path)
    found = [f"{what}: {match.group(0)!r}" for what, rule in VOCABULARY.items() for match in rule.finditer(code)]
    assert not found, f"{_relative(path)} declares {found} again; import it from lightning_memopt.vocabulary"


@pytest.mark.parametrize("path", SOURCES, ids=_relative)
def test_a_long_file_says_why(path):
    lines = len(path.read_text().splitlines())
    if lines <= MOST_LINES:
        return
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert "Over 500 lines because" in docstring, (
        f"{_relative(path)} has {lines} lines: split it by idea, or say in its docstring 'Over 500 lines because …'"
    )


def test_the_rules_see_a_breach():
    """The patterns catch what they are for (a rule that matches nothing would pass forever)."""
    breaches = {
        "from torch.utils._pytree import tree_map": PRIVATE_USES["a private torch module"],
        "trainer.fit_loop._data_source.dataloader()": PRIVATE_USES["a private attribute of a Lightning object"],
        "from lightning.fabric.utilities.init import _materialize_distributed_module": PRIVATE_USES[
            "a private name imported from torch or Lightning"
        ],
        'getattr(lightning, "_console", None)': PRIVATE_USES["a private attribute read by name"],
        "_GIB = 2**30": VOCABULARY["a unit"],
        'PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")': VOCABULARY["the precisions"],
    }
    for text, rule in breaches.items():
        assert rule.search(text), text


# the floors of the house, lowest first: a room (a subpackage, or a module at the package's root) imports only
# from rooms on floors below its own, never from a room beside it or above it
FLOORS = {
    "ground": {
        "__about__",
        "vocabulary",
        "arguments",
        "private_api",
        "batch_slicing",
        "random_generators",
        "selection",
        "registration",
        "cache",
        "distributed",
        "results_file",
    },
    "what is trained, on what": {"models", "data"},
    "what is measured": {"memory", "metrics", "losses"},
    "the techniques and tasks": {"checkpointing", "precision", "accumulation", "tasks"},
    "strategies": {"strategies"},
    "planner": {"planner"},
    "callbacks": {"callbacks"},
    "the apps": {"cli"},
    "the front doors": {"__init__", "train"},  # `import lightning_memopt`, `python -m lightning_memopt.train`
}
FLOOR_OF = {room: number for number, rooms in enumerate(FLOORS.values()) for room in rooms}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(path): path for path in SOURCES}


def _room(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _imports(module: str) -> set[str]:
    """The package's modules ``module`` imports, anywhere in it (in functions and ``TYPE_CHECKING`` blocks too)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])]
                )
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:  # a name imported from a module, or a submodule imported from a package
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


IMPORTS = {module: _imports(module) for module in MODULES}


def _circles(imports: dict[str, set[str]]) -> list[str]:
    """Every circle a walk of ``imports`` (module → the modules it imports) comes back along.

    Example::

        >>> _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
        ['a → b → c → a']
    """
    circles, state = [], {}  # state: 1 on the path being walked, 2 done

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        for imported in sorted(imports[module]):
            if state.get(imported) == 1:
                circles.append(" → ".join([*path[path.index(imported) :], imported]))
            elif imported not in state:
                walk(imported, [*path, imported])
        state[module] = 2

    for module in sorted(imports):
        if module not in state:
            walk(module, [module])
    return circles


def test_no_module_imports_round_a_circle():
    assert _circles({"a": {"b"}, "b": {"a"}}) == ["a → b → a"]  # the walk sees a circle
    circles = _circles(IMPORTS)
    assert not circles, f"import circles: {circles}"


def test_rooms_import_only_from_the_floors_below():
    unplaced = sorted({_room(module) for module in MODULES} - set(FLOOR_OF))
    assert not unplaced, f"place {unplaced} on a floor of FLOORS (tests/test_house_rules.py)"
    upward = [
        f"{module} → {imported}"
        for module, imported_modules in IMPORTS.items()
        for imported in imported_modules
        if _room(imported) != _room(module) and FLOOR_OF[_room(imported)] >= FLOOR_OF[_room(module)]
    ]
    assert not upward, f"imports from a room on the same floor or above: {sorted(upward)}"
    # the graph sees the imports (a rule that sees none would pass forever)
    assert "lightning_memopt.batch_slicing" in IMPORTS["lightning_memopt.accumulation.runner"]
    assert "lightning_memopt.checkpointing.offload" in IMPORTS["lightning_memopt.checkpointing"]
