"""The package's floor plan holds: every import in mpirt/ (at module level or inside a function)
goes to its own floor or one below (docs/architecture.md draws the floors). Pure: reads the
sources, imports nothing."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# lowest first; a module belongs to the longest prefix that names it
FLOORS = [
    ("arrays and dtypes", ["mpirt.version", "mpirt.core.backend", "mpirt.core.precision"]),
    ("CPU execution", ["mpirt.cpu"]),
    ("numerics, models, state on disk, communication, data",
     ["mpirt.core", "mpirt.models", "mpirt.checkpoint", "mpirt.comm", "mpirt.data"]),
    ("parallel layouts", ["mpirt.parallel"]),
    ("prediction, watching a run, the training config", ["mpirt.plan", "mpirt.monitor", "mpirt.run.config"]),
    ("running a job", ["mpirt.run"]),
    ("public entry modules", ["mpirt"]),
]
# imports that go up, each for a reason
UPWARD = {
    ("mpirt.core.precision", "mpirt.core.tensor"): "float32_compute reads the grad mode when a forward runs",
}


def floor_of(module: str) -> int:
    best = max(((i, len(p)) for i, (_, prefixes) in enumerate(FLOORS) for p in prefixes
                if module == p or module.startswith(p + ".")), key=lambda t: t[1])
    return best[0]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join(("mpirt", "models") + parts[1:] if parts[0] == "models" else parts)
    return name.removesuffix(".__init__")


def imports(path: Path):
    """(imported module, line) of every absolute mpirt import in the file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        else:
            continue
        yield from ((n, node.lineno) for n in names if n == "mpirt" or n.startswith("mpirt."))


def sources():
    return sorted((ROOT / "mpirt").rglob("*.py")) + sorted((ROOT / "models").rglob("*.py"))


def test_every_import_goes_down_or_sideways():
    upward = []
    for path in sources():
        me = module_name(path)
        for target, line in imports(path):
            if target != "mpirt" and floor_of(target) > floor_of(me) and (me, target) not in UPWARD:
                upward.append(f"{path.relative_to(ROOT)}:{line}: {me} ({FLOORS[floor_of(me)][0]}) imports "
                              f"{target} ({FLOORS[floor_of(target)][0]})")
    assert not upward, "imports against the floor plan:\n" + "\n".join(upward)


def test_the_plan_covers_every_package_and_its_exceptions_still_exist():
    packages = {module_name(p).rsplit(".", 1)[0] for p in sources() if p.name != "__init__.py"}
    assert all(floor_of(p) is not None for p in packages)
    present = {(module_name(p), t) for p in sources() for t, _ in imports(p)}
    assert set(UPWARD) <= present, "an exception in UPWARD is no longer needed: remove it"
