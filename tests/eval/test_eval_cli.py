"""`forage eval` as a user runs it: the command line, its exit codes, a real retriever process,
a replay in another process, and `forage inspect` reading what it wrote."""

from __future__ import annotations

import json
import subprocess
import time

import httpx
import pytest

from .conftest import FORAGE, REPO, forage


@pytest.mark.parametrize(("case", "message"), [
    ("missing-data", "no such file"),
    ("unknown-mode", "unknown mode search"),
    ("rag-without-index", "pass --index DIR"),
    ("missing-model", "--model"),
    ("samples-without-probe", "--evidence-samples needs --evidence-probe"),
])
def test_user_mistakes_are_one_line_and_exit_code_2(eval_world, tmp_path, case, message):
    base = ["eval", "--model", str(eval_world["policy"]), "--data", str(eval_world["flashrag"]),
            "--out", str(tmp_path / "out")]
    args = {
        "missing-data": ["eval", "--model", str(eval_world["policy"]), "--data",
                         str(tmp_path / "nope.parquet"), "--mode", "direct", "--out",
                         str(tmp_path / "out")],
        "unknown-mode": [*base, "--mode", "search"],
        "samples-without-probe": [*base, "--mode", "agent", "--evidence-samples", "2"],
        "rag-without-index": [*base, "--mode", "direct,rag"],
        "missing-model": ["eval", "--model", str(tmp_path / "no-model"), "--data",
                          str(eval_world["flashrag"]), "--mode", "direct", "--out",
                          str(tmp_path / "out")],
    }[case]
    done = forage(*args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.fixture()
def retriever(eval_world):
    from services.common.ports import free_port

    port = free_port()
    proc = subprocess.Popen([*FORAGE, "retriever", "serve", "--index", str(eval_world["index"]),
                             "--port", str(port)], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "the retriever exited"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the retriever did not come up"
            time.sleep(0.3)
        yield f"http://127.0.0.1:{port}/retrieve"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_record_from_a_retriever_process_then_replay_in_another_process(eval_world, tmp_path,
                                                                        retriever):
    common = ["--model", str(eval_world["policy"]), "--data", str(eval_world["search_r1"]),
              "--mode", "direct,rag", "--max-tokens-per-turn", "8", "--topk", "2",
              "--batch-size", "6"]
    recorded, replayed = tmp_path / "recorded", tmp_path / "replayed"
    done = forage("eval", *common, "--retriever-url", retriever, "--index",
                  str(eval_world["index"]), "--retrieval", "record", "--out", str(recorded))
    assert done.returncode == 0, done.stderr
    assert "6/6 questions" in done.stderr and "rag: EM" in done.stdout
    done = forage("eval", *common, "--retrieval", "replay", "--store",
                  str(recorded / "retrieval.sqlite"), "--out", str(replayed))
    assert done.returncode == 0, done.stderr
    for name in ("eval.json", "eval.md", "samples.jsonl"):
        assert (replayed / name).read_bytes() == (recorded / name).read_bytes(), name

    shown = forage("inspect", str(replayed), "--step", "1", "--limit", "1")
    assert shown.returncode == 0, shown.stderr
    assert "12 samples" in shown.stdout and "Q:      Which city was Brixol born in?" in shown.stdout


@pytest.mark.slow
def test_record_without_the_index_folder_keys_by_the_identity_the_retriever_reports(
        eval_world, tmp_path, retriever):
    """The folder is not needed to record: the running retriever's /healthz names its index,
    and the store is keyed exactly as with --index (so either replays the other)."""
    from services.eval.evaluate import EvalRequest, run
    from services.eval.retrieval import Store, read_identity, settings_key
    from services.eval.runner import EvalSettings

    out = tmp_path / "out"
    run(EvalRequest(models=[str(eval_world["policy"])], data=[str(eval_world["flashrag"])],
                    modes=["rag"], out=str(out), retriever_url=retriever, retrieval="record",
                    limit=2, settings=EvalSettings(topk=2, max_tokens_per_turn=4)))
    identity, _ = read_identity(eval_world["index"])
    served = httpx.get(retriever.replace("/retrieve", "/healthz"), timeout=10).json()
    config = json.loads((out / "config.json").read_text())
    assert config["index"] == identity
    store = Store(out / "retrieval.sqlite", create=False)
    assert store.identities() == [(identity, settings_key(served["search_settings"]))]
    store.close()
    assert {line["index"] for line in map(json.loads, (out / "samples.jsonl").open())} == \
        {identity}
