"""The package's layering, read from the source with `ast` (nothing is imported).

Rules (docs/developer/architecture.md): DeepSpeed only under astrai/engine/; astrai/algos pure torch;
astrai/checkpoint knows nothing of training; every import goes down the layers of `LAYERS` (so no circle among
astrai's packages and top-level modules, and the launcher never imports the trainer); at most 8 modules
directly in astrai/; a checkpoint's weights are read without the export's command line; no `train_type` tested
against a name outside astrai/strategies/ (a train type's facts live in its strategy, or below it in
astrai/train_types.py); no file over `LINE_BUDGET` lines but the ones named. Function-level (lazy) imports
count too: a lazy import still ties the two modules together, it only hides the circle until run time.
Imports under `if TYPE_CHECKING:` do not: they never run, they only name a type for annotations (the
strategies name `Run` of astrai/training/run_parts.py that way).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "astrai"
TRAINING_SIDE = ("strategies", "training", "resume", "engine")
REPO = PACKAGE.parent


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
            if base == "astrai":  # `from astrai import trainer` imports the module astrai.training.loops
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


# The units of astrai/ (a subpackage or a top-level module), lowest layer first. A module imports its own unit
# or a unit of a LOWER layer, never one of its own layer or above: the direction of every edge is fixed, so
# no circle can form, and a new package must be placed here. Why this order, bottom-up: export reads a
# checkpoint's weights (resume's portable form among them); the strategies start a model from them
# (model.init_from_checkpoint, the reference); eval asks the strategies for figures; the launcher's checks
# and planner ask strategies and eval what a job needs, so launch sits above them; training's loops use the
# launcher watch, resume, eval; the two entry programs sit on top.
LAYERS = [
    ("errors", "train_types", "safe_write", "_script_path"),
    ("versions", "config", "algos", "data", "checkpoint", "observability"),
    ("engine", "models", "envs"),  # envs: tools and environments, below the rollout that runs episodes
    ("rollout", "resume"),
    ("export",),
    ("strategies",),
    ("eval",),
    ("launch",),
    ("training",),
    ("train", "__main__"),
]
MAX_TOP_LEVEL_MODULES = 8


def _layer_of() -> dict[str, int]:
    return {f"astrai.{unit}": layer for layer, units in enumerate(LAYERS) for unit in units}


def test_every_unit_has_a_layer():
    units = {_unit(module) for module in _modules()} - {None}
    missing = sorted(units - set(_layer_of()))
    assert not missing, f"place these in LAYERS (tests/unit/test_layering.py): {missing}"


def test_imports_go_down_the_layers():
    layer = _layer_of()
    offenders = [
        f"{_where(name, line)}: {_unit(name)} (layer {layer[_unit(name)]}) imports {target} "
        f"(layer {layer[_unit(target)]})"
        for name, target, line in _all_imports()
        if _unit(name) in layer
        and _unit(target) in layer
        and _unit(name) != _unit(target)
        and layer[_unit(target)] >= layer[_unit(name)]
    ]
    assert not offenders, "an import that does not go down LAYERS:\n" + "\n".join(offenders)


def test_few_modules_directly_in_the_package():
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} modules directly in astrai/ (group them): {top}"


def test_every_package_has_an_init():
    """pyproject's `packages.find` installs only folders with an __init__.py: one without imports from a
    checkout (a namespace package) and is missing from the installed wheel."""
    folders = {path.parent for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts}
    missing = sorted(str(folder.relative_to(REPO)) for folder in folders if not (folder / "__init__.py").is_file())
    assert not missing, f"folders without __init__.py: {missing}"


def test_checkpoint_weights_are_read_without_the_export_command_line():
    """astrai/export/weights.py serves the model build (model.init_from_checkpoint, the reference): it imports
    neither the export's writer nor its command line (argparse, tqdm), and only the entry points and the
    export itself import astrai.export.cli."""
    banned = {"astrai.export.hf", "astrai.export.cli", "argparse", "tqdm"}
    offenders = [
        f"{_where(name, line)} imports {target}"
        for name, target, line in _all_imports()
        if (name == "astrai.export.weights" and target in banned)
        or (target == "astrai.export.cli" and _unit(name) not in ("astrai.__main__", "astrai.export"))
    ]
    assert not offenders, "the checkpoint-weights path reaches the export's CLI:\n" + "\n".join(offenders)


# ----------------------------------------------------------------------------- file sizes

LINE_BUDGET = 500
# Files allowed past LINE_BUDGET, each with its ceiling and why; a file here must not grow past its ceiling.
LINE_BUDGET_EXCEPTIONS: dict[str, tuple[int, str]] = {
    "astrai/resume/training_checkpoints.py": (545, "what a job's checkpoint holds, save and resume in one reading"),
    "astrai/engine/engines.py": (510, "the Engine / FrozenEngine pair and the ZeRO-3 sampling copy they share"),
    "tests/unit/launch/test_launch.py": (770, "one launcher's exact commands per launcher kind, table-driven"),
    "tests/unit/checkpoint/test_publish.py": (580, "the publisher's phases, each crash point asserted in order"),
    "tests/integration/test_failure_matrix.py": (525, "one table of failure cases run in one launch"),
    "benchmarks/gpu_check.py": (515, "the one-GPU validation as one script (scripts/gpu_check.sh runs it)"),
    "benchmarks/checkpoint_cost.py": (520, "one benchmark script, run standalone"),
}


def test_files_keep_to_the_line_budget():
    offenders = []
    for folder in ("astrai", "tests", "benchmarks", "scripts"):
        for path in sorted((REPO / folder).rglob("*.py")):
            relative = str(path.relative_to(REPO))
            lines = len(path.read_text().splitlines())
            ceiling, _ = LINE_BUDGET_EXCEPTIONS.get(relative, (LINE_BUDGET, ""))
            if lines > ceiling:
                offenders.append(f"{relative}: {lines} lines (at most {ceiling})")
    assert not offenders, "split these files:\n" + "\n".join(offenders)


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
