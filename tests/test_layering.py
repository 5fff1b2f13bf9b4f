"""The modules of tf_gpipe form layers: each imports only from below, so none needs an
import inside a function to break a cycle, and a reader can take them in order.

The import graph is read from the source with ``ast``, imports inside functions
included (they close a cycle as well as top-level ones, only later). A submodule's
package ``__init__`` runs before it, but only imports written out count: that is the
order Python resolves and the one a reader follows.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tf_gpipe"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, str]:
    """``{module name: its source}`` for every module of the package."""
    return {_module_name(p): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, source: str, modules: set[str], is_package: bool) -> set[str]:
    """The package's modules that ``source`` (module ``name``) imports, anywhere in it."""

    def owner(dotted: str) -> str | None:  # the module a dotted name lives in
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(owner(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package upwards
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            for a in node.names:  # `from pkg import submodule` imports the submodule
                found.add(owner(f"{base}.{a.name}"))
    return {m for m in found if m is not None and m != name}


def import_graph(sources: dict[str, str], packages: set[str] | None = None) -> dict[str, set[str]]:
    """``{module: the package's modules it imports}``; ``packages`` are the ``__init__`` ones."""
    packages = packages if packages is not None else _packages()
    modules = set(sources)
    return {name: _imports(name, src, modules, name in packages) for name, src in sources.items()}


def _packages() -> set[str]:
    return {_module_name(p) for p in PACKAGE.rglob("__init__.py")}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_no_module_imports_a_module_that_imports_it_back():
    cycle = find_cycle(import_graph(_sources()))
    assert cycle is None, (
        "tf_gpipe's modules import each other in a cycle: "
        + " -> ".join(cycle or [])
        + ". Move what they share into the lower module, or into a small module of its own."
    )


def test_the_check_sees_a_cycle_closed_inside_a_function():
    sources = {
        "tf_gpipe.low": "def f():\n    from tf_gpipe import high\n",
        "tf_gpipe.high": "from tf_gpipe.low import f\n",
        "tf_gpipe.other": "import tf_gpipe.low\n",
    }
    assert find_cycle(import_graph(sources, set())) == ["tf_gpipe.high", "tf_gpipe.low", "tf_gpipe.high"]
    sources["tf_gpipe.low"] = "def f():\n    pass\n"
    assert find_cycle(import_graph(sources, set())) is None


def imports_inside_functions(sources: dict[str, str]) -> list[str]:
    """``module:line`` for each import of a tf_gpipe module inside a function: what the
    layers make unneeded (third-party imports there, optional ones, are not counted)."""
    found = []
    for name, source in sources.items():
        for function in ast.walk(ast.parse(source)):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(function):
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                    if isinstance(node, ast.ImportFrom):
                        names = [node.module or ""] if not node.level else ["tf_gpipe"]
                    if any(n == "tf_gpipe" or n.startswith("tf_gpipe.") for n in names):
                        found.append(f"{name}:{node.lineno}")
    return found


def test_no_module_imports_the_package_inside_a_function():
    found = imports_inside_functions(_sources())
    assert not found, f"tf_gpipe modules import tf_gpipe inside a function (import at the top): {found}"
    assert imports_inside_functions(
        {"tf_gpipe.x": "def f():\n    import re\n    from tf_gpipe import y\n"}
    ) == ["tf_gpipe.x:3"]


def test_the_graph_resolves_every_kind_of_import():
    graph = import_graph(_sources())
    assert "tf_gpipe.micro_batch_loop" in graph["tf_gpipe.engine"]  # from tf_gpipe import micro_batch_loop
    assert "tf_gpipe.balance" in graph["tf_gpipe.model"]  # from tf_gpipe.balance import ...
    assert "tf_gpipe.balance.profile" in graph["tf_gpipe.balance"]  # the package's __init__
    assert len(graph) > 40


def test_both_step_builders_drive_one_stage_interface():
    """The step built out (``engine``) and as loops (``micro_batch_loop``) run a stage's
    forward and backward through ``pipeline_stage.PipelineStage`` only, not through
    ``cell_pass`` (a second path to keep in step with the first)."""
    graph = import_graph(_sources())
    for builder in ("tf_gpipe.engine", "tf_gpipe.micro_batch_loop"):
        assert "tf_gpipe.pipeline_stage" in graph[builder]
        assert "tf_gpipe.cell_pass" not in graph[builder], f"{builder} runs stages without PipelineStage"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_attributes(tree: ast.Module) -> set[str]:
    """The private attributes a module's classes define: their ``_x`` methods and class
    attributes, and every ``self._x``/``cls._x`` it assigns."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.add(item.name)
                targets = item.targets if isinstance(item, ast.Assign) else []
                targets += [item.target] if isinstance(item, ast.AnnAssign) else []
                found.update(t.id for t in targets if isinstance(t, ast.Name))
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            found.add(node.attr)
    return {n for n in found if _private(n)}


def _own(node: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: an object's reads of its own attributes."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def private_reads(sources: dict[str, str]) -> list[str]:
    """``module:line: name`` for each private name (``_x``) a module takes from another
    module of the package: ``from tf_gpipe.m import _x``, ``m._x`` on an imported module,
    or ``obj._x`` (read or written, ``getattr(obj, "_x")`` too) where ``_x`` is a private
    attribute another module's classes define (``PipelineModel``'s, a replica's) and ``obj``
    is not ``self``/``cls``. Subpackages get no exception: a name two modules share is public
    in the one that owns it."""
    modules = set(sources)
    trees = {name: ast.parse(source) for name, source in sources.items()}
    defined = {name: _private_attributes(tree) for name, tree in trees.items()}

    found = []
    for name, tree in trees.items():
        elsewhere = set().union(*(d for m, d in defined.items() if m != name))
        aliases: dict[str, str] = {}  # local name -> the package's module it is
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tf_gpipe"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if full in modules:
                        aliases[a.asname or a.name] = full
                    elif _private(a.name):
                        found.append(f"{name}:{node.lineno}: from {node.module} import {a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in modules and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                base = node.value
                if isinstance(base, ast.Name) and base.id in aliases:
                    if aliases[base.id] != name:
                        found.append(f"{name}:{node.lineno}: {base.id}.{node.attr}")
                elif node.attr in elsewhere and not _own(base):
                    found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in elsewhere
                and not _own(node.args[0])
            ):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return sorted(found, key=lambda f: (f.split(":")[0], int(f.split(":")[1])))


def test_no_module_reads_another_modules_privates():
    found = private_reads(_sources())
    assert not found, (
        "tf_gpipe modules read other modules' private names (make what they share public in "
        "the module that owns it; internal modules say so with __all__ = []):\n" + "\n".join(found)
    )


def test_the_check_sees_a_private_read():
    sources = {
        "tf_gpipe.low": "def _f():\n    pass\n",
        "tf_gpipe.high": "from tf_gpipe import low\nfrom tf_gpipe.low import _f\nlow._f()\n",
        "tf_gpipe.sub": "from tf_gpipe.sub.b import _g\n",
        "tf_gpipe.sub.b": "def _g():\n    pass\n",
        "tf_gpipe.model": (
            "class M:\n    def __init__(self):\n        self._p = 1\n"
            "    def _b(self):\n        return self._p + super()._q()\n"
        ),
        "tf_gpipe.user": (
            "def f(m, os):\n    m._b()\n    m._p = 2\n    os._exit(getattr(m, '_p'))\n"
            "    return getattr(m, '_other')\n"
        ),
    }
    assert private_reads(sources) == [
        "tf_gpipe.high:2: from tf_gpipe.low import _f",
        "tf_gpipe.high:3: low._f",
        "tf_gpipe.sub:1: from tf_gpipe.sub.b import _g",
        "tf_gpipe.user:2: m._b",
        "tf_gpipe.user:3: m._p",
        "tf_gpipe.user:4: getattr(m, '_p')",
    ]


# The modules whose __all__ is public API (docs/api.md): what tf_gpipe/__init__.py exports
# from, and the public subpackages. Every other module is the engine's own.
EXPORTING = ("tf_gpipe.model", "tf_gpipe.devices", "tf_gpipe.replay")
PUBLIC = {"tf_gpipe", "tf_gpipe.timeline", "tf_gpipe.flags", *EXPORTING}
PUBLIC_PACKAGES = ("tf_gpipe.schedules", "tf_gpipe.balance", "tf_gpipe.cluster", "tf_gpipe.plan")


def declared_all(source: str) -> list[str] | None:
    """The names a module's ``__all__`` lists (a literal list), or None if it has none."""
    for node in ast.parse(source).body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and target.id == "__all__" and isinstance(node.value, ast.List):
            return [ast.literal_eval(e) for e in node.value.elts]
    return None


def test_internal_modules_say_so():
    """``__all__ = []`` in each internal module, as torchgpipe's: that a name has no
    underscore makes it shared inside the package, not public."""
    public = [
        name
        for name, source in _sources().items()
        if name not in PUBLIC
        and not name.startswith(PUBLIC_PACKAGES)
        and name != "tf_gpipe.cluster.__main__"
        and declared_all(source) != []
    ]
    assert not public, f"internal modules without `__all__: list[str] = []`: {public}"


def test_a_public_modules_all_is_what_tf_gpipe_exports_from_it():
    exported: dict[str, set[str]] = {}
    for node in ast.parse(_sources()["tf_gpipe"]).body:
        if isinstance(node, ast.ImportFrom) and node.module in EXPORTING:
            exported.setdefault(node.module, set()).update(a.name for a in node.names)
    sources = _sources()
    assert {m: set(declared_all(sources[m]) or []) for m in EXPORTING} == exported


def test_only_keras_compat_names_keras_internals():
    """Private Keras modules (``keras.src``) are reached through tf_gpipe.keras_compat's hooks
    only, so a Keras release that moves one fails there, with its test."""
    outside = [
        name
        for name, source in _sources().items()
        if "keras.src" in source
        and name != "tf_gpipe.keras_compat"
        and not name.startswith("tf_gpipe.keras_compat.")
    ]
    assert not outside, f"modules outside tf_gpipe.keras_compat naming keras.src: {outside}"
