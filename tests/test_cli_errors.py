"""Expected failures of `forage` commands end with one error line, `forage GROUP: error: ...`
on stderr, and an exit code, never a traceback; a real bug shows its traceback and says it is
one (docs/launch.md, "When a command fails").

Every case runs the command as a process: exit code 2 for a wrong config, argument or input
(not restarted by `forage up`), 75 (EX_TEMPFAIL) for Redis not answering or a port already
taken (worth a restart), and the error is stderr's only error line and its last line.
"""

from __future__ import annotations

import ast
import errno
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from services.common.cli_errors import TEMPORARY_FAILURE, USAGE_ERROR, expected_failure
from services.common.config import ConfigError

REPO = Path(__file__).resolve().parents[1]
FORAGE = [sys.executable, "-m", "services.cli"]
DEAD_REDIS = "redis://127.0.0.1:1/0"  # port 1: nothing listens there
# docs/launch.md, "When a command fails": `forage GROUP: error: ...` or
# `forage GROUP COMMAND: error: ...`.
ERROR_LINE = re.compile(r"forage [a-z]+(?: [a-z-]+)?: error: \S")


def run(args: list[str], timeout: float = 180, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("REDIS_URL", None)
    return subprocess.run([*FORAGE, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=env, **kwargs)


def one_error_line(result: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """The error line, after checking: exit code, no traceback, one error line, the last."""
    stderr = result.stderr
    assert result.returncode == code, (result.returncode, stderr[-3000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    assert len(errors) == 1, stderr[-3000:]
    assert lines[-1] == errors[0], stderr[-3000:]
    assert ERROR_LINE.match(errors[0]), errors[0]
    for word in words:
        assert word in errors[0], errors[0]
    assert len(errors[0]) < 400, errors[0]
    return errors[0]


# ---------------------------------------------------------------- config files


BILLION_LAUGHS = "".join(
    f"{name}: &{name} [{', '.join([f'*{previous}'] * 9)}]\n"
    for previous, name in zip("abcdefgh", "bcdefghi", strict=True)
)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"a: &a [*a]\n", ["recursive"]),
        (b"run_id: " + b"[" * 100_000 + b"]" * 100_000 + b"\n", ["nested too deeply"]),
        (b"run_id: " + b"[" * 100 + b"]" * 100 + b"\n", ["nested more than 64 levels"]),
        ("run_id: caf\xe9\n".encode("latin-1"), ["not UTF-8", "0xe9", "offset 11"]),
        (b'a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]\n' + BILLION_LAUGHS.encode(),
         ["more than 100000 values"]),
        (b"run_id: [unclosed\n", ["not valid YAML"]),
    ],
    ids=["recursive", "deep", "deep-but-parseable", "latin-1", "billion-laughs", "bad-yaml"],
)
def test_a_bad_config_file_is_one_line(tmp_path, content, words):
    config = tmp_path / "run.yaml"
    config.write_bytes(content)
    started = time.monotonic()
    result = run(["score", "--config", str(config), "--data-source", "nq", "--solution", "x",
                  "--ground-truth", "y"], timeout=60)
    assert time.monotonic() - started < 30  # the billion laughs expanded for minutes
    if "not valid YAML" in words:  # PyYAML's own message spans lines: its marks are kept
        assert result.returncode == USAGE_ERROR and "Traceback" not in result.stderr
        assert "not valid YAML" in result.stderr
        return
    one_error_line(result, USAGE_ERROR, str(config), *words)


def test_a_config_path_that_is_a_directory_says_so(tmp_path):
    result = run(["score", "--config", str(tmp_path), "--data-source", "nq", "--solution", "x",
                  "--ground-truth", "y"], timeout=60)
    one_error_line(result, USAGE_ERROR, "is not a file")


def test_an_override_nested_too_deeply_is_one_line():
    deep = "[" * 10_000 + "]" * 10_000
    result = run(["score", "--set", f"run_id={deep}", "--data-source", "nq", "--solution", "x",
                  "--ground-truth", "y"], timeout=60)
    one_error_line(result, USAGE_ERROR, "nested too deeply", "20007 characters")


def test_a_bad_config_says_which_command_on_stderr():
    """Failed before: config errors were a bare `error: invalid config: ...`, and `forage demo`
    printed its own to stdout."""
    result = run(["config", "show", "--set", "learner.lrr=1"], timeout=60)
    line = one_error_line(result, USAGE_ERROR)
    assert line == ("forage config: error: invalid config: learner.lrr: unknown key (did you "
                    "mean learner.lr?); on the command line: learner.lrr=1")
    assert result.stdout == ""


def test_forage_demo_reports_a_bad_config_like_every_command(tmp_path):
    out = tmp_path / "demo"
    result = run(["demo", "--quick", "--out", str(out), "--set", "learner.lrr=1"], timeout=120)
    line = one_error_line(result, USAGE_ERROR)
    assert line.startswith("forage demo: error: invalid config: learner.lrr: unknown key")
    assert result.stdout == "" and not out.exists()


def _error_texts(tree: ast.AST) -> list[ast.Call]:
    """print(...) and SystemExit(...) calls whose first argument starts with `error:`."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        name = getattr(node.func, "id", getattr(node.func, "attr", ""))
        first = node.args[0]
        if isinstance(first, ast.JoinedStr) and first.values:
            first = first.values[0]
        while isinstance(first, ast.BinOp):  # "error: " + ...
            first = first.left
        if (name in ("print", "SystemExit") and isinstance(first, ast.Constant)
                and isinstance(first.value, str) and first.value.lstrip().startswith("error:")):
            found.append(node)
    return found


def test_no_command_prints_a_bare_error_line():
    """Every error line names its command (ERROR_LINE): a bare `error: ...` in a log that
    several services write to says nothing of which one failed."""
    assert _error_texts(ast.parse('print(f"error: {x}")\nraise SystemExit("error: " + y)'))
    assert not _error_texts(ast.parse('print(f"forage score: error: {x}")'))
    bare = [f"{path.relative_to(REPO)}:{call.lineno}"
            for path in sorted((REPO / "services").rglob("*.py"))
            for call in _error_texts(ast.parse(path.read_text()))]
    assert not bare, f"error lines without `forage GROUP: `: {bare}"


def test_config_anchors_that_expand_modestly_still_work(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(textwrap.dedent("""
        scorer:
          rewards:
            my_task: &qa [{function: qa_em, weight: 2.0}]
            other_task: *qa
    """))
    result = run(["score", "--config", str(config), "--data-source", "other_task",
                  "--solution", "<answer>Paris</answer>", "--ground-truth", "Paris"], timeout=60)
    assert result.returncode == 0, result.stderr
    assert '"score": 2.0' in result.stdout


# ---------------------------------------------------------------- forage score, corpus


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ("nope", ["--extra-info", "not valid JSON"]),
        ("[1,2]", ["--extra-info", "JSON object", "list"]),
        ("[" * 100_000, ["--extra-info", "nested too deeply"]),
    ],
    ids=["not-json", "a-list", "deep"],
)
def test_forage_score_extra_info_must_be_a_map(extra, words):
    result = run(["score", "--data-source", "nq", "--solution", "x", "--ground-truth", "y",
                  "--extra-info", extra], timeout=60)
    one_error_line(result, USAGE_ERROR, *words)


def test_forage_score_extra_info_map_reaches_the_reward():
    result = run(["score", "--data-source", "nq", "--solution", "<answer>Paris</answer>",
                  "--ground-truth", "Paris", "--extra-info", '{"split": "test"}'], timeout=60)
    assert result.returncode == 0 and '"score": 1.0' in result.stdout, result.stderr


@pytest.mark.slow
def test_a_corpus_row_nested_100k_deep_is_one_line(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": 0, "contents": "fine"}\n'
                      '{"id": 1, "contents": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    result = run(["retriever", "build-index", "--corpus", str(corpus), "--out",
                  str(tmp_path / "index"), "--no-progress", "--log-level", "ERROR"])
    one_error_line(result, USAGE_ERROR, "row 2", "nested too deeply")


# ---------------------------------------------------------------- services at start


@pytest.fixture()
def taken_port():
    """A port something already listens on."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture()
def empty_config(tmp_path) -> str:
    path = tmp_path / "run.yaml"
    path.write_text("log_level: WARNING\n")
    return str(path)


def scorer_serve(config: str, *sets: str, **kwargs) -> subprocess.CompletedProcess:
    args = ["scorer", "serve", "--config", config, "--set", "scorer.port=0"]
    for item in sets:
        args += ["--set", item]
    return run(args, **kwargs)


def rollout_serve(config: str, *sets: str) -> subprocess.CompletedProcess:
    args = ["rollout", "serve", "--config", config]
    for item in sets:
        args += ["--set", item]
    return run(args)


@pytest.mark.slow
class TestScorerServe:
    def test_no_tokenizer(self, empty_config):
        one_error_line(scorer_serve(empty_config), USAGE_ERROR, "scorer.tokenizer_path")

    def test_missing_tokenizer(self, empty_config, tmp_path):
        result = scorer_serve(empty_config, f"scorer.tokenizer_path={tmp_path / 'nope'}")
        one_error_line(result, USAGE_ERROR, "scorer.tokenizer_path", "does not exist")

    def test_redis_unreachable(self, empty_config, tiny_policy_dir):
        result = scorer_serve(empty_config, f"scorer.tokenizer_path={tiny_policy_dir}",
                              f"redis.url={DEAD_REDIS}")
        one_error_line(result, TEMPORARY_FAILURE, "no Redis answers", DEAD_REDIS)

    def test_port_in_use(self, empty_config, tiny_policy_dir, redis_url, namespace, taken_port):
        result = scorer_serve(empty_config, f"scorer.tokenizer_path={tiny_policy_dir}",
                              f"redis.url={redis_url}", f"redis.namespace={namespace}",
                              f"scorer.port={taken_port}")
        one_error_line(result, TEMPORARY_FAILURE, f"127.0.0.1:{taken_port}", "scorer.port",
                       "in use")

    def test_metrics_port_in_use(self, empty_config, tiny_policy_dir, redis_url, namespace,
                                 taken_port):
        result = scorer_serve(empty_config, f"scorer.tokenizer_path={tiny_policy_dir}",
                              f"redis.url={redis_url}", f"redis.namespace={namespace}",
                              f"scorer.metrics_port={taken_port}")
        one_error_line(result, TEMPORARY_FAILURE, f"127.0.0.1:{taken_port}", "/metrics",
                       "in use")


@pytest.mark.slow
class TestRolloutServe:
    def test_missing_model(self, empty_config, tmp_path):
        result = rollout_serve(empty_config, f"model.path={tmp_path / 'nope'}")
        one_error_line(result, USAGE_ERROR, "model.path", "does not exist")

    def test_redis_unreachable(self, empty_config, tiny_policy_dir):
        result = rollout_serve(empty_config, f"model.path={tiny_policy_dir}",
                               f"redis.url={DEAD_REDIS}")
        one_error_line(result, TEMPORARY_FAILURE, "no Redis answers", DEAD_REDIS)

    def test_metrics_port_in_use(self, empty_config, tiny_policy_dir, redis_url, namespace,
                                 taken_port):
        result = rollout_serve(empty_config, f"model.path={tiny_policy_dir}",
                               f"redis.url={redis_url}", f"redis.namespace={namespace}",
                               f"rollout.metrics_port={taken_port}")
        one_error_line(result, TEMPORARY_FAILURE, f"127.0.0.1:{taken_port}", "/metrics",
                       "in use")


# ---------------------------------------------------------------- a real bug


def test_a_bug_shows_its_traceback_and_says_so():
    """An exception nobody expected: the traceback stays (it is what a bug report needs)."""
    code = textwrap.dedent("""
        import sys
        import services.scorer.cli_score as cli_score
        from services import cli

        def broken(args):
            return {}["no such key"]

        cli_score._score = broken
        sys.exit(cli.main(["score", "--data-source", "nq", "--solution", "x",
                           "--ground-truth", "y"]))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, cwd=REPO)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "KeyError: 'no such key'" in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "forage score: internal error (KeyError); this is a bug in Forage: please report it "
        "with the traceback above")


# ---------------------------------------------------------------- the classification


def test_expected_failures_are_classified_from_real_exceptions(tmp_path):
    import redis

    from services.common.redis_server import RedisUnavailable

    client = redis.Redis.from_url(DEAD_REDIS, socket_connect_timeout=1)
    with pytest.raises(redis.exceptions.ConnectionError) as refused:
        client.ping()
    failure = expected_failure(refused.value)
    assert failure.code == TEMPORARY_FAILURE and failure.message.startswith("Redis does not")
    assert expected_failure(RedisUnavailable("no Redis")).code == TEMPORARY_FAILURE
    assert expected_failure(ConfigError("x: bad")).code == USAGE_ERROR
    with socket.socket() as first, socket.socket() as second:
        first.bind(("127.0.0.1", 0))
        first.listen()
        with pytest.raises(OSError) as taken:
            second.bind(first.getsockname())
    assert expected_failure(taken.value).code == TEMPORARY_FAILURE
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        if os.geteuid() != 0:  # root writes anyway
            with pytest.raises(PermissionError) as denied:
                (read_only / "f").write_text("x")
            assert expected_failure(denied.value).code == USAGE_ERROR
    finally:
        read_only.chmod(0o700)
    assert expected_failure(OSError(errno.ENOSPC, "No space left on device")).code == USAGE_ERROR
    assert expected_failure(KeyError("x")) is None
    assert expected_failure(OSError(errno.ENOENT, "No such file")) is None
    assert expected_failure(ValueError("a bug")) is None


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`forage doctor --json | head`: the reader is gone before the command writes; it stops
    with SIGPIPE's status and no traceback (it once ended in "internal error
    (BrokenPipeError)")."""
    read_end, write_end = os.pipe()
    proc = subprocess.Popen([*FORAGE, "config", "reference"], cwd=REPO, stdout=write_end,
                            stderr=subprocess.PIPE)
    os.close(write_end)
    os.close(read_end)  # before the command has imported anything, let alone written
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141, err.decode()
    assert b"internal error" not in err and b"Traceback" not in err and b"Exception" not in err
