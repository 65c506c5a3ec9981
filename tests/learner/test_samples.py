"""Logged trajectories: retrieved documents carried in turns (codec, both directions), decoding
with the real tokenizer, the samples.jsonl file, and a real learner writing samples (train every
`log_samples_every` steps and every evaluation) into samples.jsonl and TensorBoard."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import redis
import yaml

from services.common.codec import CodecError, decode, decode_as, encode
from services.common.formats import doc_refs
from services.common.ports import free_port as _free_port
from services.common.streams import RedisStreams
from services.common.trajectory import (
    Probe,
    PromptGroup,
    ScoredTrajectory,
    Trajectory,
    Turn,
    TurnRetrieval,
)
from services.learner.samples import SampleLog, pick, sample_row, trim_samples
from tests.suite_rules import import_or_skip

ROOT = Path(__file__).resolve().parents[2]
FRACTIONS = [0.0, 0.5, 1.0]


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def build(tokenizer, uid: str, index: int, version: int, *, question: str, truth: str,
          answer: str, data_source: str = "synth_single", kind: str = "train",
          probe: bool = True) -> ScoredTrajectory:
    """A search -> observation -> answer trajectory whose tokens decode to real text."""
    pieces = [(f"<search> who is {truth} </search>", 1),
              (f'\n\n<information>Doc 1(Title: "{truth} Vel") {truth} lives here.'
               "</information>\n\n", 0),
              (f"<answer> {answer} </answer>", 1)]
    response, mask, spans = [], [], []
    for text, masked in pieces:
        ids = tokenizer.encode(text, add_special_tokens=False)
        spans.append((len(response), len(response) + len(ids)))
        response += ids
        mask += [masked] * len(ids)
    # the passage names the truth (a gold hit); the call took 2 + index ms
    turns = [Turn(*spans[0], "search", f"who is {truth}", version,
                  docs=[{"id": f"d{index}", "title": f"{truth} Vel"}],
                  retrieval=TurnRetrieval(2.0 + index, False, 1, 0, True)),
             Turn(*spans[2], "answer", answer, version)]
    traj = Trajectory(
        uid=uid, sample_id=f"{uid}:0:{index}", data_source=data_source, policy_version=version,
        prompt_ids=tokenizer.encode(f"Question: {question}", add_special_tokens=False),
        response_ids=response, loss_mask=mask, rollout_logprobs=[-1.0] * len(response),
        turns=turns, num_searches=1, ground_truth={"target": [truth]},
        extra={"question": question, "index": index}, kind=kind,
        probe=Probe(FRACTIONS, [["x"], ["y"], ["z"]]) if probe else None,
    )
    reward = float(answer == truth)
    return ScoredTrajectory(traj, reward=reward, reward_components={"em": reward},
                            probe_scores=[0.0, 0.5, reward] if probe else None)


# ---------------------------------------------------------------- codec


def test_turn_docs_round_trip_and_stay_readable_by_older_decoders(tiny_policy):
    tokenizer = _tokenizer(tiny_policy)
    item = build(tokenizer, "g1", 0, 3, question="Where?", truth="pigir", answer="pigir")
    payload = encode(item)
    body = msgpack.unpackb(payload, raw=False)
    # Turns keep their 5-field form: a decoder that predates turn_docs reads the payload.
    assert all(len(turn) == 5 for turn in body["turns"])
    assert body["turn_docs"] == [[["d0", "pigir Vel"]], None]
    back = decode_as(payload, ScoredTrajectory)
    assert back.trajectory.turns[0].docs == [{"id": "d0", "title": "pigir Vel"}]
    assert back.trajectory.turns[1].docs is None
    # An older producer's payload (no turn_docs) decodes with no docs.
    del body["turn_docs"]
    old = decode(msgpack.packb(body, use_bin_type=True))
    assert [t.docs for t in old.trajectory.turns] == [None, None]
    # No docs anywhere: the key is not written at all.
    item.trajectory.turns[0].docs = None
    assert "turn_docs" not in msgpack.unpackb(encode(item), raw=False)


@pytest.mark.parametrize("bad,needle", [
    ([[["d0", "t"]]], "one entry per turn"),
    ("docs", "one entry per turn"),
    ([[["d0"]], None], "turn_docs[0]"),
    ([[["d0", 7]], None], "turn_docs[0]"),
])
def test_malformed_turn_docs_are_codec_errors(tiny_policy, bad, needle):
    tokenizer = _tokenizer(tiny_policy)
    body = msgpack.unpackb(encode(build(tokenizer, "g", 0, 1, question="q", truth="a",
                                        answer="a")), raw=False)
    body["turn_docs"] = bad
    with pytest.raises(CodecError) as info:
        decode(msgpack.packb(body, use_bin_type=True))
    assert needle in str(info.value)


def test_doc_refs_read_both_retrieve_shapes():
    scored = [{"document": {"id": "12", "contents": '"Mekar Stebrul"\nborn in Pigir'},
               "score": 0.9}]
    plain = [{"id": 5, "contents": "Untitled line"}]
    assert doc_refs(scored) == [{"id": "12", "title": "Mekar Stebrul"}]
    assert doc_refs(plain) == [{"id": "5", "title": "Untitled line"}]


# ---------------------------------------------------------------- decoding and the file


def test_sample_row_decodes_turns_docs_answer_and_probe(tiny_policy):
    tokenizer = _tokenizer(tiny_policy)
    item = build(tokenizer, "g1", 1, 4, question="Where was Ada born?", truth="pigir",
                 answer="zikax")
    row = sample_row(item, tokenizer, step=7, kind="train")
    assert row["question"] == "Where was Ada born?"
    assert row["step"] == 7 and row["policy_version"] == 4 and row["kind"] == "train"
    search, answer = row["turns"]
    assert "who is pigir" in search["text"].replace("  ", " ")
    assert search["query"] == "who is pigir" and search["docs"] == [{"id": "d1",
                                                                     "title": "pigir Vel"}]
    assert "<information>" in search["observation"] and "lives here" in search["observation"]
    assert answer["action"] == "answer" and answer["query"] is None
    assert "zikax" in answer["text"]
    assert row["answer"] == "zikax" and row["ground_truth"] == {"target": ["pigir"]}
    assert row["reward"] == 0.0 and row["correct"] is False
    assert row["reward_components"] == {"em": 0.0}
    assert row["probe_fractions"] == FRACTIONS and row["probe_scores"] == [0.0, 0.5, 0.0]
    json.dumps(row)  # a JSON line as it stands
    # No question in extra: the decoded prompt stands in.
    item.trajectory.extra = {}
    assert "Question:" in sample_row(item, tokenizer, step=7, kind="train")["question"]


def test_pick_spreads_over_groups(tiny_policy):
    tokenizer = _tokenizer(tiny_policy)
    items = [build(tokenizer, f"g{g}", i, 1, question="q", truth="a", answer="a", probe=False)
             for g in range(3) for i in range(2)]
    picked = [(s.trajectory.uid, s.trajectory.sample_id[-1]) for s in pick(items, 4)]
    assert picked == [("g0", "0"), ("g1", "0"), ("g2", "0"), ("g0", "1")]
    assert len(pick(items, 99)) == 6 and pick(items, 0) == []


def test_sample_log_trims_on_resume_and_moves_old_runs_aside(tmp_path, tiny_policy):
    tokenizer = _tokenizer(tiny_policy)
    items = [build(tokenizer, "g", 0, 1, question="q", truth="a", answer="a")]
    samples = SampleLog(tmp_path, tokenizer, n=2)
    for step in (1, 2, 3):
        samples.write(items, step, "train")
    path = tmp_path / "samples.jsonl"
    with path.open("a") as handle:
        handle.write('{"step": 4, "ki')  # a killed learner's half-written line
    SampleLog(tmp_path, tokenizer, n=2, resumed_step=2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert trim_samples(path, 1) == 1
    SampleLog(tmp_path, tokenizer, n=2)  # a fresh run in the same directory
    assert not path.exists()
    [old] = tmp_path.glob("samples.*.jsonl")
    assert len(old.read_text().splitlines()) == 1


# ---------------------------------------------------------------- the real learner


def _rows(count: int, source: str) -> list[dict]:
    return [{"data_source": source, "prompt": [{"role": "user", "content": f"question {i}"}],
             "reward_model": {"style": "rule", "ground_truth": {"target": [f"a{i}"]}},
             "extra_info": {"index": i, "question": f"Who is a{i}?"}} for i in range(count)]


class ScriptedServices:
    """Rollout + scorer stand-ins on the real streams: search-then-answer trajectories."""

    def __init__(self, redis_url: str, namespace: str, tokenizer) -> None:
        from services.common.config.redis import RedisSection

        self.streams = RedisStreams.from_config(RedisSection(url=redis_url, namespace=namespace))
        self.streams.ensure_group("prompts")
        self.client = redis.Redis.from_url(redis_url)
        self.namespace = namespace
        self.tokenizer = tokenizer

    def serve(self, proc: subprocess.Popen, until: float, metrics_url: str | None = None
              ) -> None:
        """Answer groups until the learner exits; with `metrics_url`, keep the last /metrics
        exposition that shows a step's retrieval health (`self.exposition`)."""
        import httpx

        self.exposition = ""
        while time.time() < until and proc.poll() is None:
            if metrics_url and "forage_learner_retrieval_" not in self.exposition:
                try:
                    text = httpx.get(metrics_url, timeout=2).text
                except httpx.HTTPError:
                    text = ""
                if 'forage_learner_retrieval_gold_hit_rate{data_source="all"}' in text:
                    self.exposition = text
            for message in self.streams.consume("prompts", "script", count=16, block_ms=100):
                group = decode_as(message.payload, PromptGroup)
                raw = self.client.get(f"{self.namespace}:weights:version")
                version = int(raw) if raw else 0
                truth = group.ground_truth["target"][0]
                items = [build(self.tokenizer, group.uid, i, version,
                               question=group.extra["question"], truth=truth,
                               answer=truth if i % 2 == 0 else "nobody",
                               data_source=group.data_source, kind=group.kind,
                               probe=group.kind == "train")
                         for i in range(group.n)]
                for item in items:
                    item.trajectory.sample_id = f"{group.uid}:{group.attempt}:" \
                                                f"{item.trajectory.sample_id[-1]}"
                self.streams.publish_many("scored", [encode(s) for s in items])
                self.streams.ack("prompts", [message.id])


@pytest.mark.slow
def test_learner_writes_samples_and_tracks_them(tmp_path, redis_url, namespace, tiny_policy):
    import_or_skip("tensorboard", "the tensorboard extra (make install: the dev extra brings it)")
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train, test = tmp_path / "train.parquet", tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(6, "synth_single")), train)
    pq.write_table(pa.Table.from_pylist(_rows(3, "synth_single") + _rows(2, "synth_multihop")),
                   test)
    run_dir = tmp_path / "run"
    metrics_port = _free_port()
    config = {"run_id": "samples-test", "run_dir": str(run_dir),
              "redis": {"url": redis_url, "namespace": namespace},
              "model": {"path": str(tiny_policy)},
              "data": {"train_files": [str(train)], "test_files": [str(test)], "n_samples": 2,
                       "seed": 3},
              "learner": {"train_batch_size": 2, "total_steps": 4, "max_staleness": 0,
                          "lr": 1e-4, "save_every": 2, "group_timeout_s": 30.0, "poll_ms": 50,
                          "weight_sync_port": _free_port(), "micro_batch_tokens": 512,
                          "eval_before": True, "eval_at_end": True, "metrics_port": metrics_port,
                          "logger": ["console", "jsonl", "tensorboard"],
                          "log_samples_every": 2, "log_samples_n": 3}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp_path / "learner.log"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "learner", "train",
                             "--config", str(path)], cwd=ROOT, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    services = ScriptedServices(redis_url, namespace, _tokenizer(tiny_policy))
    try:
        services.serve(proc, until=time.time() + 300,
                       metrics_url=f"http://127.0.0.1:{metrics_port}/metrics")
        assert proc.wait(timeout=60) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    # Evaluations at steps 0 and 4 (3 rows each), train samples at steps 2 and 4.
    assert [(r["kind"], r["step"]) for r in rows] == \
        [("eval", 0)] * 3 + [("train", 2)] * 3 + [("train", 4)] * 3 + [("eval", 4)] * 3
    train_row = rows[3]
    assert train_row["question"].startswith("Who is a")
    assert train_row["turns"][0]["docs"][0]["title"].endswith(" Vel")
    assert train_row["turns"][0]["query"].startswith("who is a")
    assert train_row["probe_scores"] is not None and train_row["policy_version"] >= 1
    assert {r["uid"] for r in rows[3:6]} != {rows[3]["uid"]}  # spread over groups
    assert rows[0]["probe_scores"] is None and rows[0]["answer"] == rows[0]["ground_truth"][
        "target"][0]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first_eval = metrics[0]
    assert first_eval["kind"] == "eval" and first_eval["eval/n"] == 5
    # retrieval health per step and source (every scripted search found its gold), in the
    # metrics line and in the learner's Prometheus exposition
    train_lines = [m for m in metrics if m["kind"] == "train"]
    assert all(m["retrieval/gold_hit_rate"] == 1.0 and m["retrieval/empty_rate"] == 0.0
               and m["retrieval/gold_hit_rate/synth_single"] == 1.0
               and m["retrieval/cache_hit_rate"] == 0.0 and m["retrieval/search_turns"] == 4
               and 2.0 <= m["retrieval/latency_p50_ms"] <= m["retrieval/latency_p99_ms"] <= 3.0
               for m in train_lines), train_lines[0]
    assert first_eval["eval/retrieval/gold_hit_rate/synth_multihop"] == 1.0
    exposed = services.exposition
    assert 'forage_learner_retrieval_gold_hit_rate{data_source="synth_single"} 1.0' in exposed
    assert 'forage_learner_retrieval_empty_rate{data_source="all"} 0.0' in exposed
    assert 'forage_learner_retrieval_latency_ms{data_source="all",quantile="0.99"}' in exposed
    assert first_eval["eval/n/synth_single"] == 3 and first_eval["eval/n/synth_multihop"] == 2
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("eval/em")] == [0, 4]
    assert {"samples/train/text_summary", "samples/eval/text_summary"} <= \
        set(events.Tags()["tensors"])
    assert "train step:3 - " in log.read_text()  # the console tracker's full line
    if os.environ.get("FORAGE_KEEP_METRICS"):  # refresh the report tests' real sample line
        Path(os.environ["FORAGE_KEEP_METRICS"]).write_text(
            (run_dir / "metrics.jsonl").read_text())
