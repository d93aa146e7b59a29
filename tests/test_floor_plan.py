"""The package's floor plan holds: every import in mpirt/ (at module level or inside a function)
goes to its own floor or one below (docs/architecture.md draws the floors). Pure: reads the
sources, imports nothing."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# lowest first; a module belongs to the longest prefix that names it (the package root's own
# modules, the public entry points, are the top floor: ROOT_MODULES)
FLOORS = [
    ("arrays and dtypes", ["mpirt.version", "mpirt.core.backend", "mpirt.core.precision"]),
    ("CPU and GPU execution", ["mpirt.cpu", "mpirt.gpu"]),
    ("numerics, models, state on disk, communication, data",
     ["mpirt.core", "mpirt.models", "mpirt.checkpoint", "mpirt.comm", "mpirt.data"]),
    ("parallel layouts", ["mpirt.parallel"]),
    ("prediction, watching a run, the training config", ["mpirt.plan", "mpirt.monitor", "mpirt.run.config"]),
    ("running a job", ["mpirt.run", "mpirt.verify"]),
    ("public entry modules", []),
]
ROOT_MODULES = {"mpirt"} | {f"mpirt.{p.stem}" for p in (ROOT / "mpirt").glob("*.py") if p.stem != "__init__"}
# imports that go up, each for a reason
UPWARD = {
    ("mpirt.core.precision", "mpirt.core.tensor"): "float32_compute reads the grad mode when a forward runs",
    ("mpirt.plan.__main__", "mpirt.run.slurm"): "the planner's command line (an entry point) writes the chosen "
                                                "layout's job script with the job writer (--emit-slurm)",
}


def floor_of(module: str) -> int | None:
    """The floor of ``module`` (None: no floor names it)."""
    if module in ROOT_MODULES - {"mpirt.version"}:
        return len(FLOORS) - 1
    found = [(len(p), i) for i, (_, prefixes) in enumerate(FLOORS) for p in prefixes
             if module == p or module.startswith(p + ".")]
    return max(found)[1] if found else None


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join(("mpirt", "models") + parts[1:] if parts[0] == "models" else parts)
    return name.removesuffix(".__init__")


def imports(path: Path, text: str | None = None):
    """(imported module, line) of every mpirt import in the file (``text``: its source, default
    read from it): ``from mpirt import x`` names ``mpirt.x``, relative imports are resolved
    against the file's package."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text() if text is None else text)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" if base in ("mpirt", package) or not node.module else base
                     for a in node.names]
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
            if target == "mpirt" or floor_of(target) is None:
                continue  # the package itself; a name imported from a module (not a module)
            if floor_of(target) > floor_of(me) and (me, target) not in UPWARD:
                upward.append(f"{path.relative_to(ROOT)}:{line}: {me} ({FLOORS[floor_of(me)][0]}) imports "
                              f"{target} ({FLOORS[floor_of(target)][0]})")
    assert not upward, "imports against the floor plan:\n" + "\n".join(upward)


def test_every_module_has_a_floor_and_the_exceptions_still_exist():
    homeless = [module_name(p) for p in sources() if floor_of(module_name(p)) is None]
    assert not homeless, f"modules on no floor (add their package to FLOORS): {homeless}"
    present = {(module_name(p), t) for p in sources() for t, _ in imports(p)}
    assert set(UPWARD) <= present, "an exception in UPWARD is no longer needed: remove it"


def test_the_checks_see_every_form_of_import():
    """``from mpirt import x``, a relative import and a function's import count like the others."""
    source = ("from mpirt import run\nfrom .. import plan\nfrom .tensor import Tensor\n"
              "def f():\n    import mpirt.monitor\n")
    found = [t for t, _ in imports(ROOT / "mpirt" / "core" / "nn.py", source)]
    assert found == ["mpirt.run", "mpirt.plan", "mpirt.core.tensor", "mpirt.monitor"]
    assert floor_of("mpirt.run") > floor_of("mpirt.core.nn") and floor_of("mpirt.train") == len(FLOORS) - 1
