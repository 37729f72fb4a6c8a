"""The package's layering, read from the source with `ast` (nothing is imported).

Rules (docs/developer/architecture.md): DeepSpeed only under astrai/engine/; astrai/algos pure torch;
astrai/checkpoint knows nothing of training; no import circle among astrai's subpackages and
top-level modules; no `train_type` tested against a name outside astrai/strategies/ (a train type's facts
live in its strategy, or below it in astrai/train_types.py). Function-level (lazy) imports count too: a
lazy import still ties the two modules together, it only hides the circle until run time. Imports under
`if TYPE_CHECKING:` do not: they never run, they only name a type for annotations (run.py names the Strategy
it holds that way).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "astrai"
TRAINING_SIDE = ("strategies", "trainer", "build", "resume", "engine")


def _modules() -> dict[str, Path]:
    """Every module of astrai/: dotted name -> file."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking_block(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`): imports for annotations only, never run."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement in the file, lazy ones included; relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    tree = ast.parse(path.read_text(), filename=str(path))
    type_only = {id(inner) for block in ast.walk(tree) if _is_type_checking_block(block) for inner in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append((base, node.lineno))
            if base == "astrai":  # `from astrai import trainer` imports the module astrai.trainer
                found += [(f"astrai.{alias.name}", node.lineno) for alias in node.names]
    return found


def _all_imports() -> list[tuple[str, str, int]]:
    """(importing module, imported module, line) over the whole package."""
    return [(name, target, line) for name, path in _modules().items() for target, line in _imports(name, path)]


def _unit(module: str) -> str | None:
    """The package-level unit a module belongs to: astrai.<first part> (a subpackage or a top-level module)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "astrai" and len(parts) > 1 else None


def _top(module: str) -> str:
    return module.split(".")[0]


def _where(name: str, line: int) -> str:
    return f"{_modules()[name].relative_to(PACKAGE.parent)}:{line}"


def test_the_scan_sees_the_package():
    """Guards the other tests against passing vacuously: the scan finds modules and the imports we know exist."""
    imports = _all_imports()
    assert len(_modules()) > 50
    assert any(target == "deepspeed" or target.startswith("deepspeed.") for _, target, _ in imports)
    assert any(_unit(target) == "astrai.engine" for name, target, _ in imports if _unit(name) == "astrai.resume")


def test_deepspeed_is_imported_only_under_engine():
    offenders = [
        f"{_where(name, line)} imports {target}"
        for name, target, line in _all_imports()
        if _top(target) == "deepspeed" and _unit(name) != "astrai.engine"
    ]
    assert not offenders, "DeepSpeed imported outside astrai/engine/:\n" + "\n".join(offenders)


def test_algos_imports_only_torch_the_standard_library_and_itself():
    allowed = set(sys.stdlib_module_names) | {"torch", "__future__"}
    offenders = [
        f"{_where(name, line)} imports {target}"
        for name, target, line in _all_imports()
        if _unit(name) == "astrai.algos"
        and not (_top(target) in allowed or target == "astrai.algos" or target.startswith("astrai.algos."))
    ]
    assert not offenders, "astrai/algos must stay pure torch:\n" + "\n".join(offenders)


def test_checkpoint_knows_nothing_of_training():
    banned = {f"astrai.{unit}" for unit in TRAINING_SIDE}
    offenders = [
        f"{_where(name, line)} imports {target}"
        for name, target, line in _all_imports()
        if _unit(name) == "astrai.checkpoint" and _unit(target) in banned
    ]
    assert not offenders, "astrai/checkpoint imports the training side:\n" + "\n".join(offenders)


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as [a, b, ..., a], or None (depth-first search, three colours)."""
    state, stack = {}, []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_reports_a_circle_and_accepts_a_tree():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_among_the_subpackages():
    edges, witness = {}, {}
    for name, target, line in _all_imports():
        source, sink = _unit(name), _unit(target)
        if source and sink and source != sink and sink in {_unit(module) for module in _modules()}:
            edges.setdefault(source, set()).add(sink)
            witness.setdefault((source, sink), _where(name, line))
    cycle = _find_cycle(edges)
    if cycle:
        steps = [f"{a} -> {b} ({witness[a, b]})" for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("import circle among astrai's packages:\n" + "\n".join(steps))


# ----------------------------------------------------------------------------- train-type facts

# A train type's facts live in its strategy (astrai/strategies/) and, for the layers below the strategies (the
# schema's load-time checks, the export), in astrai/train_types.py, one class per train type with no test of a
# name. Anywhere else a `train_type` compared with a name re-derives a fact that can drift from the run's.
# Exceptions, each with its reason: none.
TRAIN_TYPE_TEST_EXCEPTIONS: dict[str, str] = {}


def _train_type_names() -> set[str]:
    """The registered names, read from astrai/train_types.py (`name = "..."` in each rules class)."""
    tree = ast.parse((PACKAGE / "train_types.py").read_text())
    return {
        node.value.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and [getattr(target, "id", None) for target in node.targets] == ["name"]
        and isinstance(node.value, ast.Constant)
    }


def _names_train_type(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "train_type") or (
        isinstance(node, ast.Name) and node.id == "train_type"
    )


def _is_text(node: ast.AST) -> bool:
    """A string, or a tuple / list / set of strings."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and bool(node.elts) and all(map(_is_text, node.elts))


def _train_type_tests(source: str, names: set[str]) -> list[int]:
    """Lines that test a `train_type` against names: a comparison (==, !=, in, not in) with a string or a
    tuple of strings, a `match train_type` statement, or a dict literal keyed by two train types or more."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(map(_names_train_type, sides)) and any(map(_is_text, sides)):
                found.append(node.lineno)
        elif isinstance(node, ast.Match) and _names_train_type(node.subject):
            found.append(node.lineno)
        elif isinstance(node, ast.Dict):
            keys = {key.value for key in node.keys if isinstance(key, ast.Constant) and isinstance(key.value, str)}
            if len(keys & names) >= 2:
                found.append(node.lineno)
    return sorted(found)


def test_the_train_type_scan_finds_what_it_forbids():
    """Guards the rule below against passing vacuously."""
    names = _train_type_names()
    assert names == {"seq", "sft", "dpo", "grpo", "online_ppo", "rm"}
    source = (
        'if job.train.train_type == "dpo": pass\n'
        'if train_type in ("grpo", "online_ppo"): pass\n'
        'SIZES = {"dpo": 2, "rm": 2}\n'
        "match job.train.train_type:\n    case _: pass\n"
        "if saved_type != job.train.train_type: pass\n"  # two jobs compared: no name, no fact
        'if job.rl.advantage_estimator == "grpo": pass\n'  # an estimator named grpo, not a train type
    )
    assert _train_type_tests(source, names) == [1, 2, 3, 4]


def test_no_train_type_tests_outside_the_strategies():
    names = _train_type_names()
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != "strategies"
        and str(path.relative_to(PACKAGE.parent)) not in TRAIN_TYPE_TEST_EXCEPTIONS
        for line in _train_type_tests(path.read_text(), names)
    ]
    assert not offenders, (
        "train_type tested against a name outside astrai/strategies/ (ask the strategy, `strategy_class(...)`, or "
        "below it `astrai.train_types.train_type_rules(...)`):\n" + "\n".join(offenders)
    )
