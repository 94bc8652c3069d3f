"""The package layering of docs/design.md section 1, read from the source with `ast`.

- Imports flow one way: a module imports only from its own layer or a lower one (`LAYERS`),
  and no module imports a command (`python -m jfp8rl.<command>`).
- No import cycles between modules.
- Function-local imports only of the heavy optional dependencies in `LAZY_OK` (and the one
  command that must set XLA flags before jax starts).
- No module of the four packages is over 450 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("models", "losses", "rollout_bridge", "jfp8rl")
COMMANDS = {
    f"jfp8rl.{c}" for c in ("train", "eval", "export", "plan", "audit", "mismatch", "report")
}

# Lowest first; a module belongs to the longest prefix that names it.
LAYERS = (
    ("models",),
    ("losses",),
    ("rollout_bridge",),
    ("jfp8rl.data",),
    ("jfp8rl.config",),
    ("jfp8rl.parallel",),
    ("jfp8rl.observe",),
    ("jfp8rl.trainer",),
    ("jfp8rl.analysis",),
    ("jfp8rl.api",),
    tuple(sorted(COMMANDS)),
)

# Optional dependencies a module imports only where it needs them: plots, Parquet files, chat
# templates, the math verifier, TensorBoard; and the weight bridge, whose two sides run in
# different venvs (the trainer's has ml_dtypes and no torch, vLLM's torch and no jax).
LAZY_OK = {
    "matplotlib", "pyarrow", "jinja2", "math_verify", "tensorboardX", "torch", "vllm", "ml_dtypes",
}  # fmt: skip
# (module, imported module) pairs allowed inside a function, each for a reason given there.
LAZY_PROJECT_OK = {
    ("jfp8rl.plan", "jfp8rl.analysis.memory_plan"),  # after --devices sets XLA_FLAGS
    ("jfp8rl.plan", "jfp8rl.config"),
    # the Hopper kernels import Pallas' Mosaic GPU modules, ~0.4 s of every process's start
    ("models.fp8.matmul", "models.fp8.kernels.block_matmul"),
    ("models.fp8.grouped", "models.fp8.kernels.grouped_block_matmul"),
}
MAX_LINES = 450


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def layer(mod: str) -> int:
    best, rank = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    return rank


def imports(path: Path, known: set[str]) -> list[tuple[str, bool, int]]:
    """(imported project module, inside a function, line) for every import in `path`."""
    tree = ast.parse(path.read_text())
    out: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import):
                out.extend((a.name, inner, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                for a in child.names:
                    sub = f"{child.module}.{a.name}"
                    out.append((sub if sub in known else child.module, inner, child.lineno))
            visit(child, inner)

    visit(tree, False)
    return out


MODULES = modules()
GRAPH = {m: imports(p, set(MODULES)) for m, p in MODULES.items()}


def project(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_imports_flow_downward(mod: str) -> None:
    where = MODULES[mod].relative_to(REPO)
    for name, _, line in GRAPH[mod]:
        if not project(name) or mod.startswith(name + ".") or name == mod:
            continue
        assert name not in COMMANDS, f"{where}:{line} imports the command {name}"
        assert layer(name) <= layer(mod), (
            f"{where}:{line} imports {name}, a higher layer (docs/design.md section 1)"
        )


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_function_local_imports_only_for_optional_dependencies(mod: str) -> None:
    where = MODULES[mod].relative_to(REPO)
    for name, nested, line in GRAPH[mod]:
        if not nested:
            continue
        ok = name.split(".")[0] in LAZY_OK or (mod, name) in LAZY_PROJECT_OK
        assert ok, f"{where}:{line} imports {name} inside a function; import it at the top"


def test_no_import_cycles() -> None:
    edges = {
        m: {n for n, _, _ in GRAPH[m] if n in MODULES and n != m and not m.startswith(n + ".")}
        for m in MODULES
    }
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n) :] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                walk(n)
        stack.pop()
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            walk(m)


def test_modules_are_at_most_450_lines() -> None:
    long = {
        str(p.relative_to(REPO)): n
        for p in MODULES.values()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"
