"""Docs a user can trust: fast checks of README.md, docs/ and the other text users read.

- **One home for measured figures.** Every figure README.md quotes (EM percentages, gains in
  points, ratios, minutes) appears in bench/README.md, and the README section that quotes it
  links to the bench/README.md section that holds it, so a new measurement changes one place.
- **Links resolve.** Every relative link in the Markdown users read points at a file inside the
  repository, and every `#anchor` names a heading of its target (GitHub's anchor rule).
- **Nothing outside the repository.** No user-facing text cites a file a clone does not have
  (the design notes beside the repository, `DESIGN.md`): the architecture is
  docs/architecture.md, and every docs page cites it.
- **No internal process words.** Users read facts, not the project's bookkeeping: no issue
  numbers, "the issue's target", "issue notes" or work "sittings".
- **A short README** (at most 150 lines).

No subprocess and no import of Forage: the whole file runs in well under a second.
tests/test_docs_run.py runs the docs' commands.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BENCH = REPO / "bench" / "README.md"
ARCHITECTURE = REPO / "docs" / "architecture.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
MARKDOWN = [README, *DOCS, *sorted((REPO / "bench").glob("*.md")),
            *sorted((REPO / "deploy").rglob("*.md"))]
USER_TEXT = [*MARKDOWN, *sorted((REPO / "configs").glob("*.yaml"))]
README_MAX_LINES = 150


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


# --------------------------------------------------------------------------- figures

# A measured figure as README.md writes it: 47.7%, +36.4 points, 1.73× (or 4.4x), 9.7 min.
FIGURE = re.compile(
    r"(?<![\w.])(?:"
    r"\d+(?:\.\d+)?\s?%"
    r"|[+−]\d+(?:\.\d+)?(?=\s*points?\b)"
    r"|\d+(?:\.\d+)?(?:×|x\b)"
    r"|\d+(?:\.\d+)?\s?(?:min|minutes?)\b"
    r")")
BENCH_LINK = re.compile(r"\]\((?:\./)?bench/README\.md#[\w-]+\)")


def _normal_figure(figure: str) -> str:
    figure = figure.replace("−", "-")
    number = re.match(r"[+-]?\d+(?:\.\d+)?", figure).group(0)  # type: ignore[union-attr]
    unit = figure[len(number):].strip()
    if unit.startswith("min"):
        return f"{number} min"
    return number + unit


def _normal_text(text: str) -> str:
    text = " ".join(text.replace("−", "-").split())
    text = re.sub(r"(\d)\s+%", r"\1%", text)
    return re.sub(r"\bminutes?\b", "min", text)


def quoted_figures(text: str) -> list[str]:
    return [_normal_figure(m.group(0)) for m in FIGURE.finditer(text)]


def missing_figures(quoting: str, home: str) -> list[str]:
    """The figures of `quoting` that `home` does not hold, number for number."""
    home = _normal_text(home)
    missing = []
    for figure in dict.fromkeys(quoted_figures(quoting)):
        pattern = r"(?<![\d.])" + re.escape(figure) + r"(?![\d])"
        if not re.search(pattern, home):
            missing.append(figure)
    return missing


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of each section of a Markdown text; fenced blocks stay in their section."""
    found: list[tuple[str, str]] = []
    heading, body, fenced = "(top)", [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{1,6} ", line):
            found.append((heading, "\n".join(body)))
            heading, body = line.lstrip("#").strip(), []
        else:
            body.append(line)
    found.append((heading, "\n".join(body)))
    return found


def test_figure_rules_read_figures_as_written() -> None:
    text = ("EM 11.3% → 47.7 % (+36.4 points), 1.73× and 4.4x, 9.7 min, 12 minutes; "
            "not 200 steps x 8 groups, v0.2 or 3.11.")
    assert quoted_figures(text) == ["11.3%", "47.7%", "+36.4", "1.73×", "4.4x", "9.7 min",
                                    "12 min"]
    assert missing_figures("12 minutes, 2 min", "12.2 min and 102 min") == ["12 min", "2 min"]
    assert missing_figures("47.7% (+36.4 points)", "**+36.4** and 11.3% → 47.7%") == []


def test_every_figure_readme_quotes_is_in_bench_readme() -> None:
    missing = missing_figures(README.read_text(), BENCH.read_text())
    assert not missing, (
        "README.md quotes figures that bench/README.md (the one home of measured figures) does "
        f"not hold; measure and record them there first, or drop them: {missing}")


def test_readme_links_each_figure_to_its_bench_section() -> None:
    unlinked = [heading for heading, body in sections(README.read_text())
                if quoted_figures(body) and not BENCH_LINK.search(body)]
    assert not unlinked, (
        "README.md sections quote measured figures without a link to the bench/README.md "
        f"section that holds them (bench/README.md#anchor): {unlinked}")


# --------------------------------------------------------------------------- links

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def github_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (duplicates get -1, -2, ...)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"#{1,6} (.*)", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _outside_fences(text: str) -> str:
    return re.sub(r"^[ \t]*```.*?^[ \t]*```[ \t]*$", "", text, flags=re.S | re.M)


def broken_links(doc: Path) -> list[str]:
    problems = []
    for match in LINK.finditer(_outside_fences(doc.read_text())):
        target = match.group(1) or match.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        path = (doc.parent / path_part).resolve() if path_part else doc
        if REPO not in path.parents and path != REPO:
            problems.append(f"{rel(doc)}: {target} is outside the repository")
        elif not path.exists():
            problems.append(f"{rel(doc)}: {target} does not exist")
        elif anchor and path.suffix == ".md" and anchor not in github_anchors(path.read_text()):
            problems.append(f"{rel(doc)}: {target}: {rel(path)} has no heading #{anchor}")
    return problems


def test_anchor_rule_follows_github() -> None:
    text = ("# Efficacy: the demo on worlds (`bench/efficacy.py`)\n## GPU check (H200, 2×)\n"
            "```text\n# not a heading\n```\n## Results\n## Results\n")
    assert github_anchors(text) == {"efficacy-the-demo-on-worlds-benchefficacypy",
                                    "gpu-check-h200-2", "results", "results-1"}


@pytest.mark.parametrize("doc", MARKDOWN, ids=rel)
def test_links_resolve_inside_the_repository(doc: Path) -> None:
    problems = broken_links(doc)
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- outside files

OUTSIDE = re.compile(r"\.\./shared|\bshared/(?:DESIGN|reference)|\bDESIGN\.md\b|"
                     r"\bdesign notes\b|beside the repository", re.I)


@pytest.mark.parametrize("doc", USER_TEXT, ids=rel)
def test_no_text_cites_a_file_outside_the_repository(doc: Path) -> None:
    hits = [f"{rel(doc)}:{n}: {line.strip()}" for n, line in
            enumerate(doc.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert not hits, ("cites a file a clone of Forage does not have; the architecture is "
                      "docs/architecture.md:\n" + "\n".join(hits))


def test_architecture_is_in_the_repository_and_cited() -> None:
    assert ARCHITECTURE.exists(), "docs/architecture.md is the design a user reads"
    headings = " / ".join(sorted(github_anchors(ARCHITECTURE.read_text())))
    for topic in ("services", "streams", "weight-sync", "contracts", "agent-loop", "probe",
                  "life-cycle"):
        assert topic in headings, f"docs/architecture.md has no section on {topic}: {headings}"
    citing = [README, *(doc for doc in DOCS if doc != ARCHITECTURE)]
    uncited = [rel(doc) for doc in citing if "architecture.md" not in doc.read_text()]
    assert not uncited, f"these pages do not cite docs/architecture.md: {uncited}"


# --------------------------------------------------------------------------- process words

# "issue 15", "Issue #5", "the target", "issue notes", "sitting", "this session"; not the
# verb ("the learner issues 512 groups").
PROCESS_WORDS = re.compile(
    r"\bissue ?#?\d+|\bthe issue(?:'s)?\b|\bissue notes?\b|\bsittings?\b|\bthis session\b",
    re.I)


def test_process_words_rule() -> None:
    said = ["issue 15", "Issue #5", "(issue 18's files)", "the issue's target", "issue notes",
            "the next sitting", "on a quiet machine of this session"]
    assert all(PROCESS_WORDS.search(text) for text in said)
    assert not PROCESS_WORDS.search("a training step issues 512 groups; an issue with the mask")


@pytest.mark.parametrize("doc", USER_TEXT, ids=rel)
def test_no_internal_process_words(doc: Path) -> None:
    hits = [f"{rel(doc)}:{n}: {m.group(0)!r} in: {line.strip()[:120]}"
            for n, line in enumerate(doc.read_text().splitlines(), 1)
            for m in PROCESS_WORDS.finditer(line)]
    assert not hits, ("user-facing text speaks of the project's internal process; say the "
                      "fact instead (what was measured, when, on what):\n" + "\n".join(hits))


# --------------------------------------------------------------------------- README size


def test_readme_is_short() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): details belong in "
        "docs/, figures in bench/README.md")
