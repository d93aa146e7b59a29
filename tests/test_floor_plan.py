"""The package's floor plan holds: every import in mpirt/ (at module level or inside a function)
goes to its own floor or one below, and no imports go round in a circle within a floor, between
modules or between packages (docs/architecture.md draws the floors). Pure: reads the sources,
imports nothing."""
import ast
import itertools
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
# the public entry modules: the package root's own modules and every package's ``__main__``
ROOT_MODULES = {"mpirt"} | {f"mpirt.{p.stem}" for p in (ROOT / "mpirt").glob("*.py") if p.stem != "__init__"} | {
    ".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "mpirt").rglob("__main__.py")}
# imports that go up, each for a reason
UPWARD = {
    ("mpirt.core.precision", "mpirt.core.tensor"): "float32_compute reads the grad mode when a forward runs",
    ("mpirt.plan.__main__", "mpirt.run.slurm"): "the planner's command line (an entry point) writes the chosen "
                                                "layout's job script with the job writer (--emit-slurm)",
}


# circles within a floor, each for a reason: the packages or modules a circle may go round
CIRCLES = {
    ("mpirt.core.ops", "mpirt.core.tensor"): "a Tensor's operators are the ops, and every op is a Function over "
                                             "Tensors (tensor.py binds the ops after defining both)",
    ("mpirt.core.modeling", "mpirt.models"): "the bundled models register in core.modeling, which imports them at "
                                             "its first lookup when mpirt/__init__.py did not run (a process "
                                             "beside a folder named mpirt imports that folder as the namespace); "
                                             "within models, GPT-2's HF reader needs its parameter shapes",
}


def inside(module: str, entry) -> bool:
    return any(module == p or module.startswith(p + ".") for p in entry)


def allowed(circle) -> bool:
    """Whether every member of ``circle`` is inside one entry of :data:`CIRCLES`."""
    return any(all(inside(m, entry) for m in circle) for entry in CIRCLES)


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


def module_graph() -> dict:
    """module -> the modules it imports (a name imported from a module counts as the module)."""
    modules = {module_name(p): p for p in sources()}

    def owner(target):
        while target not in modules and "." in target:
            target = target.rpartition(".")[0]
        return target if target in modules else None

    return {me: {t for t in map(owner, (t for t, _ in imports(path))) if t and t != me and not me.startswith(t + ".")}
            for me, path in modules.items()}


def part_of(module: str) -> str:
    """The package a module counts in for the package circles: ``mpirt.X`` (core and run, bags of
    separate modules: ``mpirt.core.X``, ``mpirt.run.X``)."""
    parts = module.split(".")
    return ".".join(parts[:3] if parts[1:2] in (["core"], ["run"]) else parts[:2])


def part_graph(graph: dict) -> dict:
    """The module graph between packages (:func:`part_of`)."""
    parts = {}
    for m, targets in graph.items():
        parts.setdefault(part_of(m), set()).update(part_of(t) for t in targets if part_of(t) != part_of(m))
    return parts


def circles(graph: dict) -> list[tuple]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, stack, found, counter = {}, {}, [], [], itertools.count()

    def visit(v):
        index[v] = low[v] = next(counter)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def floor_circles() -> list[tuple[int, tuple]]:
    """``(floor, circle)`` of every circle of modules, and of packages, within one floor."""
    graph, found = module_graph(), []
    for floor in range(len(FLOORS)):
        mine = {m for m in graph if floor_of(m) == floor}
        modules = {m: graph[m] & mine for m in mine}
        found += [(floor, c) for c in circles(modules) + circles(part_graph(modules))]
    return found


def test_no_circles_within_a_floor():
    """Within each floor, no modules (and no packages) import each other round a circle: a circle
    forces a function-local import and means the two are one concern split in two."""
    wrong = [f"{FLOORS[floor][0]}: {' <-> '.join(c)}" for floor, c in floor_circles() if not allowed(c)]
    assert not wrong, "import circles within a floor:\n" + "\n".join(wrong)


def test_every_module_has_a_floor_and_the_exceptions_still_exist():
    homeless = [module_name(p) for p in sources() if floor_of(module_name(p)) is None]
    assert not homeless, f"modules on no floor (add their package to FLOORS): {homeless}"
    present = {(module_name(p), t) for p in sources() for t, _ in imports(p)}
    assert set(UPWARD) <= present, "an exception in UPWARD is no longer needed: remove it"
    found = [c for _, c in floor_circles()]
    gone = [entry for entry in CIRCLES if not any(all(inside(m, entry) for m in c) for c in found)]
    assert not gone, f"circles in CIRCLES no longer there: remove them: {gone}"


def test_the_checks_see_every_form_of_import():
    """``from mpirt import x``, a relative import and a function's import count like the others."""
    source = ("from mpirt import run\nfrom .. import plan\nfrom .tensor import Tensor\n"
              "def f():\n    import mpirt.monitor\n")
    found = [t for t, _ in imports(ROOT / "mpirt" / "core" / "nn.py", source)]
    assert found == ["mpirt.run", "mpirt.plan", "mpirt.core.tensor", "mpirt.monitor"]
    assert floor_of("mpirt.run") > floor_of("mpirt.core.nn") and floor_of("mpirt.train") == len(FLOORS) - 1
