"""Docs a user can trust: fast checks of README.md, docs/ and the other text users read.

- **One home for measured figures.** Every figure README.md quotes (EM percentages, gains in
  points, ratios, minutes) appears in bench/README.md, and the README section that quotes it
  links to the bench/README.md section that holds it, so a new measurement changes one place.
- **Links resolve.** Every relative link in the Markdown users read points at a file inside the
  repository, and every `#anchor` names a heading of its target (GitHub's anchor rule).
- **Nothing outside the repository.** No user-facing text, source comment or .proto cites a
  file a clone does not have (the design notes beside the repository, `DESIGN.md`): the
  architecture is docs/architecture.md, and every docs page cites it.
- **Cited paths exist.** Every repository path the docs, configs, sources and .proto files cite
  (`docs/…`, `tests/…`, `bench/…`) exists, and every `tests/….py::test_name` names a test of
  that file.
- **Facts that follow the code.** The tool-call outcomes docs/rollout.md lists are the ones the
  rollout code counts; the Redis retry total docs/streams.md quotes is the one its defaults
  give; docs/deploy.md names the GPU image's Python and every image
  deploy/local-base-images.sh stands in for; every `docker compose run` the docs give has
  `--no-deps`.
- **No internal process words.** Users read facts, not the project's bookkeeping: no issue
  numbers, "the issue's target", "issue notes" or work "sittings".
- **A short README** (at most 150 lines).

No subprocess and no import of Forage (sources are read as text or parsed with `ast`): the
whole file runs in about a second.
tests/test_docs_run.py runs the docs' commands.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
RESULTS = REPO / "RESULTS.md"
BENCH = REPO / "bench" / "README.md"
ARCHITECTURE = REPO / "docs" / "architecture.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
MARKDOWN = [README, RESULTS, REPO / "CHANGELOG.md", *DOCS, *sorted((REPO / "bench").glob("*.md")),
            *sorted((REPO / "deploy").rglob("*.md"))]
USER_TEXT = [*MARKDOWN, *sorted((REPO / "configs").glob("*.yaml"))]
# Text a user reads beside the docs: the sources' docstrings and comments, the .proto contracts,
# the deploy files.
SOURCE_TEXT = [*sorted((REPO / "proto").rglob("*.proto")),
               *sorted((REPO / "services").rglob("*.py")), *sorted((REPO / "bench").rglob("*.py")),
               *sorted(p for p in (REPO / "deploy").rglob("*")
                       if p.is_file() and p.suffix in {".sh", ".yaml", ".yml", ".json", ""}),
               REPO / "docker-compose.yml", REPO / "kustomization.yaml", REPO / "Makefile",
               REPO / "pyproject.toml"]
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


def test_every_figure_results_quotes_is_in_bench_readme() -> None:
    missing = missing_figures(RESULTS.read_text(), BENCH.read_text())
    assert not missing, (
        "RESULTS.md quotes figures that bench/README.md (the one home of measured figures) does "
        f"not hold: {missing}")


def test_results_links_each_claim_to_its_bench_section() -> None:
    unlinked = [heading for heading, body in sections(RESULTS.read_text())
                if quoted_figures(body) and not BENCH_LINK.search(body)]
    assert not unlinked, f"RESULTS.md claims without a bench/README.md#section link: {unlinked}"


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


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except (UnicodeDecodeError, FileNotFoundError):  # a binary file, a file not in this clone
        return []


@pytest.mark.parametrize("doc", USER_TEXT, ids=rel)
def test_no_text_cites_a_file_outside_the_repository(doc: Path) -> None:
    hits = [f"{rel(doc)}:{n}: {line.strip()}" for n, line in
            enumerate(doc.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert not hits, ("cites a file a clone of Forage does not have; the architecture is "
                      "docs/architecture.md:\n" + "\n".join(hits))


def test_no_source_cites_a_file_outside_the_repository() -> None:
    hits = [f"{rel(path)}:{n}: {line.strip()}" for path in SOURCE_TEXT
            for n, line in enumerate(_lines(path), 1) if OUTSIDE.search(line)]
    assert not hits, ("a comment, docstring or .proto cites a file a clone of Forage does not "
                      "have; cite docs/ instead:\n" + "\n".join(hits))


# --------------------------------------------------------------------------- cited paths

# A repository path as text cites it: docs/rollout.md, tests/launch/test_demo.py::test_x.
CITED_PATH = re.compile(
    r"(?<![\w./-])((?:docs|bench|deploy|configs|services|tests|proto)/[\w./-]*\w"
    r"\.(?:md|py|ya?ml|sh|proto|json|toml))(?:::(\w+))?")
# Files a user writes, named in examples: configs/my_rewards.py, "in configs/run.yaml".
EXAMPLE_PATHS = re.compile(r"(?:^|/)my_\w+\.\w+$|^configs/run\.yaml$")


def stale_citations(path: Path) -> list[str]:
    problems = []
    for n, line in enumerate(_lines(path), 1):
        for match in CITED_PATH.finditer(line):
            cited, test = match.groups()
            target = REPO / cited
            if EXAMPLE_PATHS.search(cited):
                continue
            if not target.exists():
                problems.append(f"{rel(path)}:{n}: {cited} does not exist")
            elif test and not re.search(rf"^\s*(?:async\s+)?def {test}\(", target.read_text(),
                                        re.M):
                problems.append(f"{rel(path)}:{n}: {cited} has no test {test}")
    return problems


def test_cited_path_rule() -> None:
    found = [m.groups() for m in CITED_PATH.finditer(
        "see docs/rollout.md, `tests/launch/test_demo.py::test_x` and bench/README.md; not "
        "runs/demo/config.yaml, services/<service>/cli.py or tests/deploy/*.py")]
    assert found == [("docs/rollout.md", None), ("tests/launch/test_demo.py", "test_x"),
                     ("bench/README.md", None)]
    assert EXAMPLE_PATHS.search("configs/my_rewards.py")
    assert not EXAMPLE_PATHS.search("configs/tiny.yaml")


def test_every_cited_path_and_test_exists() -> None:
    problems = [problem for path in [*USER_TEXT, *SOURCE_TEXT]
                for problem in stale_citations(path)]
    assert not problems, ("text cites a file or test that is not in the repository (renamed or "
                          "removed?):\n" + "\n".join(problems))


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


# --------------------------------------------------------------------------- facts of the code


def _literal_values(path: Path, name: str) -> list[str]:
    """The strings of `NAME = Literal["a", "b", ...]` in a source file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) == name
                and isinstance(node.value, ast.Subscript)):
            found = [c.value for c in ast.walk(node.value.slice)
                     if isinstance(c, ast.Constant) and isinstance(c.value, str)]
            if found:
                return found
    raise AssertionError(f"{rel(path)} has no {name} = Literal[...]")


def _field_default(path: Path, name: str) -> float:
    """The default of `name: T = Field(default=X, ...)` (or `= X`) in a config source file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name
                and node.value is not None):
            value = node.value
            if isinstance(value, ast.Call):
                value = next(k.value for k in value.keywords if k.arg == "default")
            return float(ast.literal_eval(value))
    raise AssertionError(f"{rel(path)} has no field {name}")


def test_rollout_doc_lists_every_tool_call_outcome() -> None:
    """forage_rollout_tool_calls_total's outcome label: what a call that ran came to
    (tool_runner.ToolOutcome) or why one could not run (tool_calls.ErrorKind). Both the prose
    under "Limits" and the metrics table list each."""
    ran = _literal_values(REPO / "services/rollout/tool_runner.py", "ToolOutcome")
    unparsed = _literal_values(REPO / "services/common/tool_calls.py", "ErrorKind")
    outcomes = {*ran, *unparsed}
    # The agent loop counts built-in tools itself: every outcome it names is one of these.
    agent = ast.parse((REPO / "services/rollout/agent.py").read_text())
    counted = {c.value for node in ast.walk(agent)
               if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "labels"
               and ast.unparse(node.func.value).endswith("TOOL_CALLS") and len(node.args) == 2
               for c in ast.walk(node.args[1]) if isinstance(c, ast.Constant)}
    assert counted, "no metrics.TOOL_CALLS.labels(tool, outcome) found in agent.py"
    assert counted <= outcomes, f"agent.py counts outcomes no Literal names: {counted - outcomes}"
    text = (REPO / "docs/rollout.md").read_text()
    prose = text[text.index("Outcomes are counted per tool"):text.index("### MCP servers")]
    (row,) = [line for line in text.splitlines()
              if line.startswith("| `forage_rollout_tool_calls_total")]
    for where, body in (("the Limits section", prose), ("the metrics table", row)):
        missing = [o for o in sorted(outcomes) if f"`{o}`" not in body]
        assert not missing, f"docs/rollout.md, {where}, does not list outcomes {missing}"


def test_streams_doc_quotes_the_retry_total_of_the_defaults() -> None:
    config = REPO / "services/common/config/redis.py"
    attempts = int(_field_default(config, "retry_attempts"))
    base = _field_default(config, "retry_backoff_s")
    cap = _field_default(config, "retry_backoff_max_s")
    sleeps = [min(cap, base * 2**k) for k in range(attempts - 1)]  # streams.backoff_delay
    total = f"{sum(sleeps):.1f} s"
    said = re.search(r"add up to (\d+(?:\.\d+)?) s", (REPO / "docs/streams.md").read_text())
    assert said and f"{said.group(1)} s" == total, (
        f"docs/streams.md, \"Connection loss\": the default retries sleep {total} in all "
        f"({sleeps}), the doc says {said.group(0) if said else 'nothing'}")
    assert f"sleep {total} in all" in config.read_text(), f"{rel(config)}'s comment: {total}"


def test_deploy_doc_names_the_images_the_deploy_files_use() -> None:
    dockerfile = (REPO / "deploy/Dockerfile").read_text()
    deploy_doc = (REPO / "docs/deploy.md").read_text()
    (python,) = set(re.findall(r"\b(python3\.\d+) -m venv\b", dockerfile))
    version = python.removeprefix("python")
    assert f"Python {version} venv" in deploy_doc, (
        f"docs/deploy.md should say the GPU image's venv is Python {version} (deploy/Dockerfile)")
    # deploy/local-base-images.sh stands in for the cpu target's base and compose's images.
    script = (REPO / "deploy/local-base-images.sh").read_text()
    compose = (REPO / "docker-compose.yml").read_text()
    images = re.findall(r"(?im)^FROM\s+(\S+)\s+AS\s+cpu\s*$", dockerfile)
    for service in re.findall(r"\$\(compose_image ([\w-]+)\)", script):
        block = re.search(rf"(?ms)^  {re.escape(service)}:\n(.*?)(?=^  \S|\Z)", compose)
        assert block, f"docker-compose.yml has no service {service}"
        images += re.findall(r"^\s+image:\s*(\S+)", block.group(1), re.M)
    assert len(images) == 4, images
    section = deploy_doc[deploy_doc.index("### Air-gapped builds"):]
    section = section[:section.index("\n## ")]
    missing = [image for image in images if f"`{image}`" not in section]
    assert not missing, ("docs/deploy.md, \"Air-gapped builds\", does not name stand-ins that "
                         f"deploy/local-base-images.sh builds: {missing}")


def test_every_documented_compose_run_has_no_deps() -> None:
    """`docker compose run SERVICE` first starts what SERVICE depends on: for the learner, Redis,
    the hours-long index build and the retriever. A one-off command needs none of it."""
    runs = [(rel(doc), n, line.strip()) for doc in MARKDOWN
            for n, line in enumerate(doc.read_text().splitlines(), 1)
            if re.search(r"docker[ -]compose run\b", line)]
    assert runs, "the docs give no `docker compose run` command any more: drop this check"
    without = [f"{doc}:{n}: {line}" for doc, n, line in runs if "--no-deps" not in line]
    assert not without, "`docker compose run` without --no-deps:\n" + "\n".join(without)
