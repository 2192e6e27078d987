"""The layout's rules, read from the source: no import cycles, and the boundaries hold.

Every `import` statement counts, wherever it stands (inside a function, under TYPE_CHECKING):
a cycle that only type checkers see is still two modules that cannot be understood apart.
`from pkg import name` is an edge to `pkg.name` when that is a module, else to `pkg` itself.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "supervisor", "worker")
WITH_BENCH = (*PACKAGES, "bench")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    return {_module_name(p): p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imported(tree: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> Iterator[str]:
    """Every name `module` imports: `pkg.name` where that is a module of ours, else `pkg` (relative resolved)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base


def import_graph(packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """module -> the project modules it imports (never a parent package implicitly)."""
    modules = _modules(packages)
    graph = {}
    for name, path in modules.items():
        targets = _imported(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", modules)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def top_level_imports() -> dict[str, set[str]]:
    """module -> the top-level package of everything it imports (third-party included)."""
    modules = _modules()
    return {name: {t.split(".")[0] for t in _imported(ast.parse(path.read_text()), name, path.name == "__init__.py",
                                                       modules)}
            for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_graph_sees_the_imports_it_must() -> None:
    graph = import_graph()
    assert "supervisor.router" in graph["supervisor.daemon"]
    assert "supervisor.errors" in graph["supervisor.registry"]  # from supervisor.errors import ModelNotFound
    assert "supervisor.errors" in graph["supervisor.router"]  # from supervisor import errors: the module
    assert "supervisor.cli" in graph["supervisor.__main__"]  # from supervisor.cli import main: the package
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_supervisor_and_worker_never_import_each_other_and_protocol_neither() -> None:
    graph = import_graph()
    for module, targets in graph.items():
        side = module.split(".")[0]
        others = {"supervisor": ("worker",), "worker": ("supervisor",), "protocol": ("supervisor", "worker")}[side]
        crossing = sorted(t for t in targets if t.split(".")[0] in others)
        assert not crossing, f"{module} imports {crossing}"


def test_only_the_mlx_engine_imports_mlx() -> None:
    for module, names in top_level_imports().items():
        if module.startswith("worker.mlx_engine"):
            continue
        assert not names & {"mlx", "mlx_lm"}, f"{module} imports MLX"


def test_the_lifecycle_core_imports_neither_the_gateway_nor_the_cli() -> None:
    """The flat core (router, policy, process, ...) is used by the gateway and CLI, never the reverse;
    daemon.py assembles the gateway and the router, so it alone may import both."""
    graph = import_graph()
    core = [m for m, path in _modules().items() if path.parent == ROOT / "supervisor" and path.name != "__init__.py"
            and m not in ("supervisor.daemon", "supervisor.__main__")]
    assert "supervisor.router" in core
    for module in core:
        upward = sorted(t for t in graph[module] if t.startswith(("supervisor.gateway", "supervisor.cli")))
        assert not upward, f"{module} imports {upward}"


def test_the_worker_loop_imports_no_mlx_at_run_time() -> None:
    """The static check above, proven in a fresh interpreter: the loop and its parts load no MLX."""
    code = ("import sys, worker.loop, worker.shutdown, worker.faults, worker.channel, worker.engine_api, "
            "worker.memory\nbad = [m for m in sys.modules if m == 'mlx' or m.startswith(('mlx.', 'mlx_lm'))]\n"
            "assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


# --- bench/, and what runs without MLX -------------------------------------------------------

# The worker's entry points build the engine (function-local imports): every other module of protocol/,
# supervisor/ and worker/ outside worker/mlx_engine/ is documented as running without MLX
# (supervisor/__init__.py, worker/mlx_engine/__init__.py), so it may not import MLX, not even through another.
MLX_ENTRY_POINTS = ("worker.__main__", "worker.group_main")
MLX_NAMES = ("mlx", "mlx_lm", "worker.mlx_engine")


def _runtime_only(tree: ast.AST) -> ast.AST:
    """`tree` without its `if TYPE_CHECKING:` bodies: imports there name types and never run."""

    class Strip(ast.NodeTransformer):
        def visit_If(self, node: ast.If) -> ast.AST | list[ast.stmt]:
            test = node.test
            if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
                    (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
                return [self.visit(n) for n in node.orelse]
            self.generic_visit(node)
            return node

    return Strip().visit(tree)


def runtime_imports() -> dict[str, set[str]]:
    """module -> every name it imports when it runs (function-local included, TYPE_CHECKING not), ours or not."""
    modules = _modules()
    return {name: set(_imported(_runtime_only(ast.parse(path.read_text(), str(path))), name,
                                path.name == "__init__.py", modules))
            for name, path in modules.items()}


def _is_mlx(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in MLX_NAMES)


def mlx_path(start: str, imports: dict[str, set[str]]) -> list[str] | None:
    """A chain of run-time imports from `start` to MLX or the MLX engine, or None."""
    seen = {start}
    todo = [[start]]
    while todo:
        path = todo.pop()
        for name in sorted(imports.get(path[-1], ())):
            if _is_mlx(name):
                return [*path, name]
            if name in imports and name not in seen:
                seen.add(name)
                todo.append([*path, name])
    return None


def test_the_runtime_import_scan_sees_function_local_imports_and_skips_type_only_ones() -> None:
    imports = runtime_imports()
    assert "worker.mlx_engine.engine" in imports["worker.__main__"]  # inside a function
    assert "worker.mlx_engine.kv_blocks" not in imports["worker.hot_cache"]  # under TYPE_CHECKING
    assert mlx_path("a", {"a": {"b"}, "b": {"os", "worker.mlx_engine.engine"}}) == \
        ["a", "b", "worker.mlx_engine.engine"]
    assert mlx_path("a", {"a": {"b"}, "b": {"a", "numpy"}}) is None


def test_modules_documented_as_mlx_free_never_import_mlx_or_the_engine_even_indirectly() -> None:
    imports = runtime_imports()
    free = [m for m in imports if not _is_mlx(m) and m not in MLX_ENTRY_POINTS]
    assert {"worker.hot_cache", "worker.loop", "worker.ssd_cache", "supervisor.router"} <= set(free)
    for module in free:
        path = mlx_path(module, imports)
        assert path is None, "an MLX-free module imports MLX: " + " -> ".join(path or [])


def test_no_import_cycles_in_bench_and_no_product_module_imports_bench() -> None:
    graph = import_graph(WITH_BENCH)
    assert "bench.client" in graph["bench.run"]  # from bench import client as cl: the module
    bench = {m: {t for t in targets if t.startswith("bench")} for m, targets in graph.items() if m.startswith("bench")}
    cycle = find_cycle(bench)
    assert cycle is None, "import cycle in bench/: " + " -> ".join(cycle or [])
    for module, targets in graph.items():
        if not module.startswith("bench"):
            assert not {t for t in targets if t.startswith("bench")}, f"{module} imports bench/"


COLLABORATORS = ("supervisor.lifecycle", "supervisor.resume", "supervisor.admission")  # the Router's (router.py)


def test_the_routers_collaborators_meet_only_through_their_interfaces() -> None:
    """lifecycle.py, resume.py and admission.py import neither each other nor the router: they talk through
    core_api.py's Protocols (and lease.py's Lease), which import none of them either."""
    graph = import_graph()
    for module in COLLABORATORS:
        others = sorted(t for t in graph[module] if t in (*COLLABORATORS, "supervisor.router"))
        assert not others, f"{module} imports {others}: go through supervisor/core_api.py"
    assert "supervisor.core_api" in graph["supervisor.lifecycle"]  # the check sees what it must
    for interface in ("supervisor.core_api", "supervisor.lease"):
        inward = sorted(t for t in graph[interface] if t in (*COLLABORATORS, "supervisor.router"))
        assert not inward, f"{interface} imports {inward}"


def _base_names(node: ast.ClassDef) -> list[str]:
    """The plain names of a class's bases (`Generic[T]` counts as `Generic`)."""
    bases = (b.value if isinstance(b, ast.Subscript) else b for b in node.bases)
    return [b.id if isinstance(b, ast.Name) else b.attr for b in bases if isinstance(b, ast.Name | ast.Attribute)]


def test_no_core_class_inherits_another_to_share_state() -> None:
    """The supervisor's classes are composed, not stacked: a class anywhere in supervisor/ may subclass a
    library's, or an error class another error class, never another supervisor class."""
    classes = {node.name: _base_names(node) for m, p in _modules().items() if m.startswith("supervisor")
               for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.ClassDef)}
    errors = {"Exception", "RuntimeError", "ValueError", "OSError"}
    while grown := {name for name, bases in classes.items() if name not in errors and errors & set(bases)}:
        errors |= grown  # errors name kinds of failure and share no state: their hierarchy is allowed
    for module, path in _modules().items():
        if not module.startswith("supervisor"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name not in errors:
                inherited = [b for b in _base_names(node) if b in classes]
                assert not inherited, f"{module}.{node.name} inherits {inherited}: compose instead"
