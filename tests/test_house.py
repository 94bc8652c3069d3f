"""The repository holds its own code only: no tracked file carries another project's copyright
or licence header, and the references of tests/reference/ import the projects they compare
against (verl from its PyPI package, scripts/setup_verl_env.sh) rather than holding copies."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "tests" / "reference"

# The phrases that open a licence header (Apache, MIT, BSD, GPL, SPDX tags), case-insensitive.
# Built from parts so that this file's own lines do not match.
HEADER = re.compile(
    "|".join(
        [
            "copy" + r"right\s+(\(c\)\s*)?(19|20)\d\d",
            "licensed under" + r" the",
            "spdx-" + "license-identifier",
            "permission is" + r" hereby granted",
            "gnu (lesser )?general" + r" public license",
            "all rights" + r" reserved",
        ]
    ),
    re.IGNORECASE,
)
HEAD_LINES = 40
# verl's rollout-correction helper and the torch_functional helpers it calls: defined in verl,
# never here.
VERL_FUNCTIONS = {
    "compute_rollout_correction_and_rejection_mask", "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask", "compute_is_metrics", "compute_rs_metrics",
    "compute_offpolicy_metrics", "_parse_rollout_rs_thresholds", "_parse_rollout_is_threshold",
    "masked_sum", "masked_mean",
}  # fmt: skip


def tracked_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    return [REPO / f for f in out.split("\0") if f and (REPO / f).is_file()]


def licence_header(path: Path) -> str | None:
    """The first line among `path`'s first HEAD_LINES that opens a licence header, else None."""
    with path.open("rb") as f:
        head = [f.readline().decode("utf-8", errors="replace") for _ in range(HEAD_LINES)]
    return next((line.strip() for line in head if HEADER.search(line)), None)


def test_no_tracked_file_carries_another_projects_licence_header() -> None:
    found = {
        str(p.relative_to(REPO)): h
        for p in tracked_files()
        if p.name != "LICENSE" and (h := licence_header(p))
    }
    assert not found, "files with a licence header (another project's code?):\n" + "\n".join(
        f"  {p}: {h}" for p, h in sorted(found.items())
    )


def test_the_header_check_finds_a_copied_file(tmp_path: Path) -> None:
    copied = tmp_path / "helper.py"
    copied.write_text(
        "# Copy" + "right 2025 Someone Ltd.\n#\n# Licensed under the Apache License\n"
    )
    assert licence_header(copied) == "# Copy" + "right 2025 Someone Ltd."
    assert licence_header(Path(__file__)) is None


def test_reference_imports_verl_rather_than_holding_it() -> None:
    tree = ast.parse((REFERENCE / "verl_ref.py").read_text())
    imported = {
        f"{node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    } | {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert "verl.trainer.ppo.rollout_corr_helper" in imported
    for path in REFERENCE.glob("*.py"):
        defined = {
            node.name
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        assert not defined & VERL_FUNCTIONS, (
            f"{path.name} defines verl's {defined & VERL_FUNCTIONS}"
        )
    assert not list(REFERENCE.rglob("verl/")), "tests/reference holds a verl package"
