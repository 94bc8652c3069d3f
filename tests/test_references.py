"""Every repository path that the README, docs/, code, comments, configs and scripts cite
exists: a reader who follows a reference finds the file."""

from __future__ import annotations

import importlib
import re
from decimal import ROUND_HALF_UP, Decimal
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


# Markdown links ([text](target), images too) in the README and docs/: relative targets only.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def markdown_pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def anchors(page: Path) -> set[str]:
    """The heading anchors GitHub gives `page`: lower case, punctuation but `-` and `_`
    dropped, spaces as `-`, a repeated heading numbered `-1`, `-2`, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in re.sub(r"```.*?```", "", page.read_text(), flags=re.S).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_markdown_links_resolve() -> None:
    """Every relative link of the README and docs/ names a file of the repository and, with a
    `#fragment` into a markdown page, one of its headings."""
    broken = []
    for page in markdown_pages():
        for target in LINK.findall(CODE.sub("", page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(REPO)}: ({target})"
            if not dest.exists() or REPO not in (dest, *dest.parents):
                broken.append(f"{where}: no such file")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                broken.append(f"{where}: no heading #{fragment} in {dest.relative_to(REPO)}")
    assert not broken, "broken links:\n  " + "\n  ".join(broken)


DOC_PAGE = re.compile(r"docs/[\w./-]+\.md")
# Versions (jax 0.11.2, Python 3.12) are not figures.
VERSION = re.compile(r"\b\d+\.\d+\.\d+\b|(?i:python|jax|verl|vllm|torch|transformers)[ -]v?[\d.]+")
# A measured figure: a decimal number, or a number with a unit.
FIGURE = re.compile(
    r"(?P<approx>(?:about|~)\s*)?(?<![\w.-])(?P<num>\d+\.\d+(?![\w.])|\d+(?:\.\d+)?"
    r"(?=x\b|%| ?(?:GB|GiB|MB|MiB|ms|s|min|minutes|hours|nats)\b))"
)
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?")


def quoted_figures() -> list[tuple[str, bool, list[str], str]]:
    """(figure, approximate?, the docs pages cited beside it, the README item) for every
    figure in a README paragraph or list item that cites a docs page."""
    text = re.sub(r"```.*?```", "", (REPO / "README.md").read_text(), flags=re.S)
    out = []
    for item in re.split(r"\n\s*\n|\n(?=\s*[-*] )", text):
        pages = sorted(set(DOC_PAGE.findall(item)))
        prose = VERSION.sub("", re.sub(r"`[^`]*`", "", item))
        for m in FIGURE.finditer(prose) if pages else ():
            out.append((m.group("num"), bool(m.group("approx")), pages, item.strip()[:70]))
    return out


def appears(figure: str, approx: bool, text: str) -> bool:
    """`text` holds `figure`, or a more precise number that rounds to it; "about N" also
    accepts a number within 10% (about 17 minutes: 16 min 43 s)."""
    want = Decimal(figure)
    places = Decimal(1).scaleb(want.as_tuple().exponent)
    for found in NUMBER.findall(text):
        got = Decimal(found)
        if got.as_tuple().exponent <= want.as_tuple().exponent and (
            got.quantize(places, rounding=ROUND_HALF_UP) == want
        ):
            return True
        if approx and abs(got - want) <= max(Decimal(1), want / 10):
            return True
    return False


def test_readme_figures_appear_in_the_docs_they_cite() -> None:
    """A figure the README quotes beside a docs page (a measurement: accuracy, a speed-up, a
    time) is in that page, so the README never quotes a number without its source."""
    figures = quoted_figures()
    missing = [
        f"{fig} (in {item!r}...) not in {', '.join(pages)}"
        for fig, approx, pages, item in figures
        if not any(appears(fig, approx, (REPO / p).read_text()) for p in pages)
    ]
    assert not missing, "README figures without their source:\n  " + "\n  ".join(missing)


def test_the_figure_check_reads_figures_and_their_sources() -> None:
    # The README quotes the SmolLM2 learning run's accuracies beside docs/real_models.md.
    assert ("0.58", False, ["docs/real_models.md"]) in [f[:3] for f in quoted_figures()]
    assert appears("0.58", False, "| 0.141 | 0.312 | **0.578** |")
    assert not appears("0.58", False, "0.5 and 0.6, 0.585, 1.58")
    assert appears("17", True, "+0.44 in 16 min 43 s wall")
    assert not appears("17", False, "16 min 43 s")


def test_anchors_follow_githubs_heading_ids(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        "# The FP8 study\n## Part A: the audit (`python -m jfp8rl.audit`)\n"
        "```\n# not a heading\n```\n## Discussion: the paper's claim\n## Tests\n### Tests\n"
    )
    assert anchors(page) == {
        "the-fp8-study", "part-a-the-audit-python--m-jfp8rlaudit",
        "discussion-the-papers-claim", "tests", "tests-1",
    }  # fmt: skip
