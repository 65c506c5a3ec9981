"""Docs that run: every shell and Python block in README.md and docs/*.md is executed as written.

The convention, by the info string of a fenced block (docs/README-style, one word after the
language):

- ```bash and ```python: runnable on a CPU machine with this repository installed, from the
  repository root. The slow test below runs them.
- ```bash gpu: needs a GPU node, Docker or a cluster. Not run; `bash -n` checks its syntax.
- ```bash long: runnable here but takes many minutes (`make test`, `make demo`, the test
  suite, benchmarks). Not run; syntax-checked, and the make targets it names must exist.
- ```text: output, synopses and layouts; ```yaml / ```json: data, which must parse.
- Every fence has an info string, so a command cannot hide in an untagged block, and every
  `forage ...` line in any block must name an existing sub-command and existing options.

How the runnable blocks run (`test_docs_run`, marked slow): one working copy for the whole
session — a temp directory holding a copy of configs/ and a `.venv` link to this repository's
venv, with `.venv/bin` first on PATH — as a user who follows the docs in one checkout has.
README.md runs first (its "Try it" builds runs/world, which the other docs say they start
from), then docs/*.md in alphabetical order. Each file's blocks run in order as one bash script
(`set -eo pipefail`; a Python block is written to a file and run with `.venv/bin/python` at its
place), so a failing command fails the test with the script's output. Long-running services
are written in the docs themselves the way a user runs them: started with `&`, waited for with
a health-check loop (`until curl -sf URL; do sleep 1; done`), stopped with `kill %N` (or
waited for, as `forage up` ends by itself). A file that leaves a process running fails. Redis
is a private embedded server (REDIS_URL), flushed between files, so runs never meet another
test's streams. Sizes in the docs' commands are the ones a user should run first (configs/tiny.yaml,
the small synthetic world), which keeps the whole test to a few minutes on 2 cores.

Set FORAGE_DOCS_WORKDIR to keep the working copy in a directory of your choice (for debugging).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
VENV_BIN = Path(sys.executable).parent
FENCE = re.compile(r"^([ \t]*)```([^\n`]*)\n(.*?)^[ \t]*```[ \t]*$", re.S | re.M)
RUNNABLE = {"bash", "python"}
NOT_RUN = {"bash gpu", "bash long", "text", "yaml", "json"}
FILE_TIMEOUT_S = 900  # a hang guard, not a speed target (README: 276-420 s on a busy machine)


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    info: str
    body: str

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    text = doc.read_text()
    return [Block(doc, text.count("\n", 0, match.start()) + 1, match.group(2).strip(),
                  textwrap.dedent(match.group(3))) for match in FENCE.finditer(text)]


ALL_BLOCKS = [block for doc in DOCS for block in blocks(doc)]


def test_every_fence_is_tagged_with_a_known_kind() -> None:
    bad = [f"{b.where} ```{b.info}" for b in ALL_BLOCKS if b.info not in RUNNABLE | NOT_RUN]
    assert not bad, f"untagged or unknown fence kinds (see this test's docstring): {bad}"


def test_docs_have_runnable_blocks() -> None:
    runnable = [b for b in ALL_BLOCKS if b.info in RUNNABLE]
    assert len(runnable) >= 10
    assert any(b.doc.name == "README.md" for b in runnable)


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.info.startswith("bash")],
                         ids=lambda b: b.where)
def test_shell_blocks_parse(block: Block) -> None:
    done = subprocess.run(["bash", "-n"], input=block.body, capture_output=True, text=True)
    assert done.returncode == 0, f"{block.where}: {done.stderr}"


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.info in ("yaml", "json")],
                         ids=lambda b: b.where)
def test_data_blocks_parse(block: Block) -> None:
    if block.info == "yaml":
        yaml.safe_load(block.body)
    else:
        json.loads(block.body)


def test_long_blocks_name_existing_make_targets() -> None:
    targets = set(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))
    for block in ALL_BLOCKS:
        if block.info == "bash long":
            for target in re.findall(r"^\s*make ([\w-]+)", block.body, re.M):
                assert target in targets, f"{block.where}: make {target} is not in the Makefile"


def _forage_lines(body: str) -> list[list[str]]:
    """The words of each `forage ...` command in a block (continuations joined)."""
    joined = re.sub(r"\\\n\s*", " ", body)
    found = []
    for line in joined.splitlines():
        code = re.split(r"(?:^|\s)#", line, maxsplit=1)[0]  # comments are prose
        for match in re.finditer(r"(?:^|&&|;|\|)\s*(?:\.venv/bin/)?forage\s+([^;&|]*)", code):
            try:
                words = shlex.split(match.group(1), posix=True)
            except ValueError:
                words = match.group(1).split()
            if words and not any(w.endswith(":") for w in words[:2]):  # "forage x: ..." is output
                found.append(words)
    return found


def test_every_documented_forage_command_exists() -> None:
    """A synopsis rots silently: check the sub-command and each --option of every `forage`
    line in every block against the real parsers (with "|" alternatives and [optional]
    brackets read as a synopsis writes them)."""
    import argparse

    from services.cli import COMMAND_GROUPS, build_parser

    problems = []
    for block in ALL_BLOCKS:
        for words in _forage_lines(block.body):
            if not words or words[0] not in COMMAND_GROUPS:
                if words and not words[0].startswith("-"):
                    problems.append(f"{block.where}: forage {words[0]}: no such command")
                continue
            parser = build_parser(words[0])
            rest = words[1:]
            subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            if subs and rest and not rest[0].startswith("-"):
                for name in rest[0].split("|"):
                    if name.strip("[]") and name.strip("[]") not in subs[0].choices:
                        problems.append(f"{block.where}: forage {words[0]} {name}: no such "
                                        "sub-command")
                first = rest[0].split("|")[0].strip("[]")
                parser = subs[0].choices.get(first, parser)
            options = {o for a in parser._actions for o in a.option_strings}
            for word in rest:
                for option in re.findall(r"(?:^|\[|\|)(--?[a-zA-Z][\w-]*)", word):
                    if option not in options:
                        problems.append(f"{block.where}: forage {words[0]}: no option {option}")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- running them


def _script(doc: Path, runnable: list[Block], scratch: Path) -> str:
    lines = ["set -eo pipefail"]
    for index, block in enumerate(runnable):
        lines.append(f"echo \"[$(date +%T)] >>> {block.where} ({block.info})\"")
        if block.info == "python":
            path = scratch / f"{doc.stem}_{index}.py"
            path.write_text(block.body)
            lines.append(f".venv/bin/python {shlex.quote(str(path))}")
        else:
            lines.append(block.body)
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory):
    from services.common.redis_server import start_embedded_redis

    chosen = os.environ.get("FORAGE_DOCS_WORKDIR")
    root = Path(chosen) if chosen else tmp_path_factory.mktemp("docs-run")
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(root / "configs", ignore_errors=True)
    shutil.copytree(REPO / "configs", root / "configs")
    if not (root / ".venv").exists():
        (root / ".venv").symlink_to(VENV_BIN.parent)
    server = start_embedded_redis()
    yield root, server.url
    server.stop()


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _leftovers(sid: int, grace_s: float = 15.0) -> list[str]:
    """Processes still in the script's session (a server being stopped gets `grace_s`)."""
    deadline = time.monotonic() + grace_s
    while True:
        done = subprocess.run(["ps", "-o", "pid=,args=", "-s", str(sid)], capture_output=True,
                              text=True)
        left = [line.strip() for line in done.stdout.splitlines() if line.strip()]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


# README.md's blocks are the quick start end to end: 125 s on a quiet box, 224 s on a slower
# one (bench/README.md, the test suite), 276-420 s on a busy one.
README_SLOW = pytest.mark.allow_slow(reason="README.md's blocks run the quick start end to end: "
                                     "125-224 s on a quiet box, up to 420 s on a busy one")


# docs/vllm-cpu.md starts vLLM's CPU build under `forage up` on SmolLM2: about 4 minutes.
VLLM_SLOW = pytest.mark.allow_slow(reason="docs/vllm-cpu.md runs forage up on vLLM's CPU build "
                                   "with SmolLM2: vLLM's start and two learner steps, ~4 min")
SLOW_DOCS = {REPO / "README.md": README_SLOW, REPO / "docs" / "vllm-cpu.md": VLLM_SLOW}


@pytest.mark.slow
@pytest.mark.parametrize("doc", [pytest.param(d, marks=SLOW_DOCS[d]) if d in SLOW_DOCS
                                 else d for d in DOCS
                                 if any(b.info in RUNNABLE for b in blocks(d))],
                         ids=lambda d: d.name)  # a doc with no runnable block has nothing to run
def test_docs_run(doc: Path, workdir: tuple[Path, str]) -> None:
    root, redis_url = workdir
    runnable = [b for b in blocks(doc) if b.info in RUNNABLE]
    import redis

    for port in sorted({int(p) for b in runnable for p in re.findall(r"localhost:(\d+)", b.body)}):
        assert _port_free(port), (f"port {port} is in use: {doc.name}'s commands serve on it "
                                  "and would talk to whatever listens there")
    redis.Redis.from_url(redis_url).flushall()
    scratch = root / ".docs-blocks"
    scratch.mkdir(exist_ok=True)
    script = scratch / f"{doc.stem}.sh"
    script.write_text(_script(doc, runnable, scratch))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{root / '.venv' / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
               REDIS_URL=redis_url, OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
               HF_HUB_OFFLINE="1")
    started = time.monotonic()
    process = subprocess.Popen(["bash", str(script)], cwd=root, env=env, text=True,
                               errors="replace", stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=FILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{doc.name}: still running after {FILE_TIMEOUT_S}s\n{output[-6000:]}")
    left = _leftovers(process.pid)
    if left:
        os.killpg(process.pid, signal.SIGKILL)
    elapsed = time.monotonic() - started
    assert process.returncode == 0, (f"{doc.name}: a documented command failed "
                                     f"(exit {process.returncode})\n{output[-8000:]}")
    assert not left, f"{doc.name} leaves processes running (stop them in the doc): {left}"
    print(f"{doc.name}: {len(runnable)} blocks in {elapsed:.0f}s")
    if doc.name in FIGURE_CHECKS:
        FIGURE_CHECKS[doc.name](doc.read_text(), root)


def _tasks_figures(text: str, root: Path) -> None:
    """The synthetic world's sizes and the demonstrations' accuracies quoted in docs/tasks.md are
    the ones `forage data synth` measures for README's world (seed 0, small)."""
    summary = json.loads((root / "runs" / "world" / "world.json").read_text())["summary"]
    sft = summary["sft"]
    expected = [
        f"small = {summary['docs']} passages, {summary['train_questions']} train / "
        f"{summary['test_questions']} test",
        f"{sft['rows']} demonstrations",
        *(f"{100 * sft['accuracy'][name]:.1f}%" for name in ("good", "guess", "sloppy")),
    ]
    model = json.loads((root / "runs" / "world" / "model" / "config.json").read_text())
    expected.append(f"demo world's {model['vocab_size'] / 1000:.1f}k-token vocabulary")
    flat = " ".join(text.split())
    missing = [figure for figure in expected if figure not in flat]
    assert not missing, f"docs/tasks.md quotes stale figures; it should say: {missing}"


def _configs_read_what_readme_builds(text: str, root: Path) -> None:
    """`forage up --config configs/example.yaml` is the natural next step after "Try it" (the
    README says so): every input path of the shipped example and tiny configs must be there."""
    from services.common.config import load_config

    for name in ("example.yaml", "tiny.yaml"):
        cfg = load_config(root / "configs" / name, environ={})
        paths = [cfg.model.path, cfg.retriever.index_dir, *cfg.data.train_files,
                 *cfg.data.test_files]
        missing = [p for p in paths if p and not (root / p).exists()]
        assert not missing, f"configs/{name} reads {missing}, which README's Try it did not build"


FIGURE_CHECKS = {"tasks.md": _tasks_figures, "README.md": _configs_read_what_readme_builds}
