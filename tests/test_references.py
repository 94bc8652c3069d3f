"""Every repository path that the README, docs/, code, comments, configs and scripts cite
exists: a reader who follows a reference finds the file."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOP = ("models", "losses", "rollout_bridge", "jfp8rl", "tests", "docs", "scripts", "benchmarks",
       "configs", "results")  # fmt: skip
SUFFIXES = (".py", ".md", ".sh", ".yaml", ".toml", ".png", ".json", ".jsonl", ".npz")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(TOP) + r")/[\w./-]*\w)")
# Paths that a run or a command creates (runs/, a run's files), not repository files.
CREATED = re.compile(r"/(run|runs|arms)/|<|\*|\{")


def cited_paths() -> dict[str, list[str]]:
    """path -> where it is cited ("file:line")."""
    out: dict[str, list[str]] = {}
    files = [REPO / "README.md", REPO / "pyproject.toml"]
    for top in TOP:
        if top == "results":
            continue  # raw run files: their configs name paths of the machine they ran on
        files += [p for p in (REPO / top).rglob("*") if p.suffix in (".py", ".md", ".sh", ".yaml")]
    for f in files:
        for i, line in enumerate(f.read_text().splitlines(), 1):
            for m in PATH.finditer(line):
                path = m.group(1).rstrip(".")
                if path.endswith(SUFFIXES) and not CREATED.search(path):
                    out.setdefault(path, []).append(f"{f.relative_to(REPO)}:{i}")
    return out


def test_every_cited_path_exists() -> None:
    missing = {p: where for p, where in cited_paths().items() if not (REPO / p).exists()}
    assert not missing, "cited but not in the repository:\n" + "\n".join(
        f"  {p} (cited at {', '.join(w[:3])})" for p, w in sorted(missing.items())
    )


DOTTED = re.compile(r"(?<![\w/.-])((?:jfp8rl|models|losses|rollout_bridge)(?:\.\w+)+)")


# Not ours: the `tokenizers` library's own `models` module.
FOREIGN = {"models.BPE"}


def resolves(name: str) -> bool:
    """`name` is a module, or a module's attribute (one level, or a class's member)."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        mod = REPO.joinpath(*parts[:k])
        if mod.with_suffix(".py").is_file() or (mod / "__init__.py").is_file():
            rest = parts[k:]
            if not rest:
                return True
            if len(rest) > 2:
                return False
            obj = importlib.import_module(".".join(parts[:k]))
            for attr in rest:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
    return False


def test_every_cited_module_and_name_exists() -> None:
    cited: dict[str, str] = {}
    for f in [REPO / "README.md", *(REPO / "docs").rglob("*.md")] + [
        p for top in ("models", "losses", "rollout_bridge", "jfp8rl", "tests", "scripts",
                      "benchmarks", "configs") for p in (REPO / top).rglob("*")
        if p.suffix in (".py", ".md", ".sh", ".yaml")
    ]:  # fmt: skip
        for i, line in enumerate(f.read_text().splitlines(), 1):
            for m in DOTTED.finditer(line):
                cited.setdefault(m.group(1).rstrip("."), f"{f.relative_to(REPO)}:{i}")
    missing = {n: w for n, w in cited.items() if n not in FOREIGN and not resolves(n)}
    assert not missing, "cited but not defined:\n" + "\n".join(
        f"  {n} (cited at {w})" for n, w in sorted(missing.items())
    )
