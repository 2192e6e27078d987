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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


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


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (never a parent package implicitly)."""
    modules = _modules()
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
