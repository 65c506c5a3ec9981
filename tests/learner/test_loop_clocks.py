"""The learner's clocks and its evaluation pacing, on a real Redis (issue: "Rollout throughput
defaults", "Start-up ordering").

The loop's stream side runs for real (`LearnerLoop._start_driver`: datasets, ledger, streams,
weight-sync and metrics servers; `_issue`, `_receive`, `_evaluate`), without the trainer, which
none of these behaviours touches. A thread plays the rollout replica + scorer: it takes prompt
groups from the stream like a replica (consumer group `rollout`) and answers on the scored
stream with hand-made trajectories.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from services.common.codec import decode_as, encode
from services.common.config import load_config
from services.common.config.redis import RedisSection
from services.common.streams import RedisStreams
from services.common.trajectory import PromptGroup, ScoredTrajectory, Trajectory, Turn
from services.launch.progress import format_line
from services.learner.loop import LearnerLoop
from services.learner.prompts import eval_subset


def _rows(count: int, source: str = "synth_single", start: int = 0) -> list[dict]:
    return [{"data_source": source,
             "prompt": [{"role": "user", "content": f"question {i}"}],
             "reward_model": {"style": "rule", "ground_truth": {"target": [f"a{i}"]}},
             "extra_info": {"index": i}} for i in range(start, start + count)]


def _write(path: Path, rows: list[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture()
def make_loop(tmp_path, redis_url, namespace, tiny_policy):
    """make(test_rows, **learner) -> a LearnerLoop whose driver side is running."""
    loops: list[LearnerLoop] = []

    def make(test_rows: list[dict] | None = None, train_rows: list[dict] | None = None,
             **learner) -> LearnerLoop:
        overrides = [
            f"run_dir={tmp_path / 'run'}", f"redis.url={redis_url}",
            f"redis.namespace={namespace}", f"model.path={tiny_policy}",
            f"data.train_files=[{_write(tmp_path / 'train.parquet', train_rows or _rows(6))}]",
            "data.n_samples=2", "learner.weight_sync_port=0", "learner.poll_ms=50",
            "learner.logger=[jsonl]", "learner.log_samples_n=0", "learner.max_staleness=0",
            "learner.train_batch_size=2",
        ]
        if test_rows:
            test = _write(tmp_path / "test.parquet", test_rows)
            overrides.append(f"data.test_files=[{test}]")
        overrides += [f"learner.{key}={value}" for key, value in learner.items()]
        loop = LearnerLoop(load_config(None, overrides))
        loop._start_driver()
        loops.append(loop)
        return loop

    yield make
    for loop in loops:
        loop._shutdown()


def _trajectory(group: PromptGroup, index: int, *, error: bool = False) -> Trajectory:
    response = [7 + index, 8, 9]
    return Trajectory(
        uid=group.uid, sample_id=f"{group.uid}:{group.attempt}:{index}",
        data_source=group.data_source, policy_version=group.policy_version_min,
        prompt_ids=[1, 2, 3], response_ids=response, loss_mask=[1] * len(response),
        rollout_logprobs=[-1.0] * len(response), turns=[Turn(0, len(response), "answer")],
        finish_reason="error" if error else "answer", ground_truth=group.ground_truth,
        error="retriever unreachable" if error else None, kind=group.kind,
    )


class Replica(threading.Thread):
    """Takes groups one at a time, in stream order, and answers each with `answer(group)`
    (a list of (sample index, failed) pairs) on the scored stream."""

    def __init__(self, redis_url: str, namespace: str,
                 answer: Callable[[PromptGroup], list[tuple[int, bool]]] | None = None,
                 delay_s: float = 0.0,
                 on_take: Callable[[RedisStreams, PromptGroup], None] | None = None,
                 reward: Callable[[PromptGroup, int], float] | None = None) -> None:
        super().__init__(daemon=True)
        self.streams = RedisStreams.from_config(RedisSection(url=redis_url, namespace=namespace))
        self.streams.ensure_group("prompts")
        self.answer = answer or (lambda group: [(i, False) for i in range(group.n)])
        self.delay_s = delay_s
        self.on_take = on_take
        self.reward = reward or (lambda group, index: 1.0)
        self.taken: list[PromptGroup] = []
        self.stop = threading.Event()
        self.problems: list[BaseException] = []

    def run(self) -> None:
        try:
            if self.stop.wait(self.delay_s):
                return
            while not self.stop.is_set():
                for message in self.streams.consume("prompts", "replica", count=1, block_ms=50):
                    group = decode_as(message.payload, PromptGroup)
                    self.taken.append(group)
                    if self.on_take is not None:
                        self.on_take(self.streams, group)
                    scored = [ScoredTrajectory(_trajectory(group, i, error=failed),
                                               reward=self.reward(group, i))
                              for i, failed in self.answer(group)]
                    self.streams.publish_many("scored", [encode(s) for s in scored])
                    self.streams.ack("prompts", [message.id])
        except BaseException as exc:  # surfaced by the test
            self.problems.append(exc)

    def __enter__(self) -> Replica:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join(timeout=10)
        self.streams.close()
        assert not self.problems, self.problems


def _prompts(loop: LearnerLoop) -> list[PromptGroup]:
    client = loop.streams.client
    return [decode_as(f[b"payload"], PromptGroup)
            for _, f in client.xrange(loop.streams.key("prompts"))]


def test_a_group_waiting_untaken_is_not_timed_out(make_loop):
    """group_timeout_s counts from when a replica takes the group, not from its publication:
    groups queued while every replica still loads are not re-issued for the wait."""
    loop = make_loop(group_timeout_s=0.5)
    loop._issue()
    assert [g.uid for g in _prompts(loop)] == list(loop.ledger.groups)  # two groups
    time.sleep(1.0)  # twice the timeout, and no replica has read the stream
    loop._issue()
    assert loop.ledger.accounting()["reissued_timeout"] == 0 and len(_prompts(loop)) == 2
    # A replica takes the first group and never answers: its clock starts now.
    [message] = loop.streams.consume("prompts", "replica", count=1, block_ms=100)
    taken = decode_as(message.payload, PromptGroup).uid
    loop._issue()
    time.sleep(1.0)
    loop._issue()
    assert loop.ledger.accounting()["reissued_timeout"] == 1
    [again] = _prompts(loop)[2:]
    assert (again.uid, again.attempt) == (taken, 1)
    time.sleep(1.0)  # the re-issue waits in the stream: its clock has not started
    loop._issue()
    assert loop.ledger.accounting()["reissued_timeout"] == 1


def test_a_group_lost_from_the_stream_still_times_out(make_loop):
    """A group no replica can ever take (a Redis that restarted empty lost its entry) is not
    waited for forever: its clock starts and the timeout issues it again."""
    loop = make_loop(group_timeout_s=0.5)
    loop._issue()
    first_id = next(iter(loop.untaken.values()))
    loop.streams.client.xdel(loop.streams.key("prompts"), first_id)
    loop._issue()
    time.sleep(1.0)
    loop._issue()
    assert loop.ledger.accounting()["reissued_timeout"] == 1  # the lost one; the other waits
    assert [g.attempt for g in _prompts(loop)] == [0, 1]


def test_the_evaluation_clock_starts_when_a_replica_takes_a_question(
        make_loop, redis_url, namespace):
    """Step-0 evaluation while the replicas still load: eval_timeout_s (0.5 s here) starts when
    the first question is taken, so a replica that comes after 1.5 s still answers them all."""
    loop = make_loop(_rows(3), eval_timeout_s=0.5)
    with Replica(redis_url, namespace, delay_s=1.5):
        record = loop._evaluate()
    assert record["eval/n"] == 3 and record["eval/missing"] == 0
    assert record["eval/seconds"] > 1.5


def test_the_evaluation_asks_a_fixed_capped_subset(make_loop, redis_url, namespace):
    """learner.eval_max_questions: 4 of 10 questions, split over the sources in proportion
    (6 synth_single + 4 synth_multihop -> 2.4 + 1.6 -> 2 + 2 by largest remainder), the same
    rows every time."""
    rows = _rows(6) + _rows(4, "synth_multihop", start=6)
    loop = make_loop(rows, eval_max_questions=4)
    with Replica(redis_url, namespace) as replica:
        record = loop._evaluate()
    assert record["eval/n"] == 4 and record["eval/missing"] == 0
    assert record["eval/n/synth_single"] == 2 and record["eval/n/synth_multihop"] == 2
    chosen = eval_subset(rows, 4)
    assert chosen == eval_subset(rows, 4) and len(chosen) == 4
    asked = sorted(g.uid for g in replica.taken if g.kind == "eval")
    assert asked == sorted(f"eval-v{loop.version}-{i}" for i in chosen)


def test_eval_subset_is_proportional_deterministic_and_in_file_order():
    rows = _rows(70) + _rows(25, "b", start=70) + _rows(5, "c", start=95)
    chosen = eval_subset(rows, 10)
    assert chosen == sorted(chosen) and len(set(chosen)) == 10
    sources = [rows[i]["data_source"] for i in chosen]
    assert (sources.count("synth_single"), sources.count("b"), sources.count("c")) == (7, 2, 1)
    assert chosen == eval_subset([dict(r) for r in rows], 10)  # the rows decide, nothing else
    assert eval_subset(rows, 0) == list(range(100)) == eval_subset(rows, 500)
    assert chosen[:7] != list(range(7))  # spread over the source, not its first rows


def test_evaluation_questions_do_not_starve_training_groups(make_loop, redis_url, namespace):
    """With learner.eval_max_in_flight 2, at most 2 published questions are unanswered at any
    time, and the training groups the learner issues during the evaluation are taken by the
    replica before the evaluation's last questions: they queue behind the window, not behind
    the whole test set."""
    loop = make_loop(_rows(8), eval_max_in_flight=2)
    outstanding: list[int] = []
    answered = [0]

    def on_take(streams: RedisStreams, group: PromptGroup) -> None:
        published = [decode_as(f[b"payload"], PromptGroup).kind
                     for _, f in streams.client.xrange(streams.key("prompts"))].count("eval")
        if group.kind == "eval":
            outstanding.append(published - answered[0])
            answered[0] += 1

    with Replica(redis_url, namespace, on_take=on_take) as replica:
        record = loop._evaluate()
    assert record["eval/n"] == 8
    kinds = [g.kind for g in replica.taken]
    last_eval = len(kinds) - 1 - kinds[::-1].index("eval")
    assert "train" in kinds[:last_eval], kinds
    assert max(outstanding) <= 2, outstanding


def test_a_repeated_failure_of_an_old_issue_does_not_spend_attempts(
        make_loop, redis_url, namespace):
    """A failed search's trajectory delivered twice (at least once delivery) is one failure:
    the question is issued again once, and its re-issue's answer counts."""
    loop = make_loop(_rows(1), max_attempts=2)

    def answer(group: PromptGroup) -> list[tuple[int, bool]]:
        if group.kind == "eval" and group.attempt == 0:
            return [(0, True), (0, True)]  # the failure, and a redelivery of it
        return [(i, False) for i in range(group.n)]

    with Replica(redis_url, namespace, answer=answer) as replica:
        record = loop._evaluate()
    assert record["eval/n"] == 1 and record["eval/failed"] == 0
    assert [g.attempt for g in replica.taken if g.kind == "eval"] == [0, 1]


def test_sampled_evaluation_reports_mean_and_pass_at_n(make_loop, redis_url, namespace):
    """learner.eval_samples 3 at temperature 1: each question is one group of 3 sampled
    answers; eval/em is the mean over samples (mean@3) and eval/pass@3 the share of questions
    some sample answered. A failed sample issues its question again (its samples of the
    failed issue are replaced by the re-issue's), a redelivered sample counts once, a sample
    index outside the group is left out, and
    eval_max_in_flight counts sequences: 3 of them are one question at a time."""
    rows = _rows(2) + _rows(2, "synth_multihop", start=2)
    loop = make_loop(rows, eval_samples=3, eval_temperature=1.0, eval_max_in_flight=3)
    hits = {0: 3, 1: 1, 2: 0, 3: 2}  # question index -> samples answered right

    def answer(group: PromptGroup) -> list[tuple[int, bool]]:
        if group.kind == "eval" and group.uid.endswith("-3") and group.attempt == 0:
            return [(0, False), (1, True), (2, False)]  # the failed search: issued again
        if group.kind == "eval":  # 3 is outside the group; 0 is delivered twice
            return [(3, False), (0, False), (0, False), (1, False), (2, False)]
        return [(i, False) for i in range(group.n)]

    def reward(group: PromptGroup, index: int) -> float:
        question = int(group.uid.rsplit("-", 1)[1]) if group.kind == "eval" else 0
        return float(index < hits[question])

    outstanding: list[int] = []
    answered = [0]

    def on_take(streams: RedisStreams, group: PromptGroup) -> None:
        if group.kind == "eval" and group.attempt == 0:
            published = sum(1 for _, f in streams.client.xrange(streams.key("prompts"))
                            if decode_as(f[b"payload"], PromptGroup).kind == "eval")
            outstanding.append(published - answered[0])
            answered[0] += 1

    with Replica(redis_url, namespace, answer=answer, reward=reward,
                 on_take=on_take) as replica:
        record = loop._evaluate()
    asked = [g for g in replica.taken if g.kind == "eval"]
    assert {g.n for g in asked} == {3}
    assert all(g.sampling == {"temperature": 1.0, "top_p": 1.0, "top_k": 0} for g in asked)
    assert record["eval/n"] == 4 and record["eval/missing"] == 0 and record["eval/failed"] == 0
    assert record["eval/samples_per_question"] == 3 and record["eval/temperature"] == 1.0
    assert record["eval/em"] == pytest.approx(6 / 12)
    assert record["eval/pass@3"] == pytest.approx(3 / 4)
    assert record["eval/pass@3/synth_single"] == 1.0
    assert record["eval/pass@3/synth_multihop"] == 0.5
    assert record["eval/em/synth_multihop"] == pytest.approx(2 / 6)
    assert record["eval/n/synth_single"] == 2 and record["eval/n/synth_multihop"] == 2
    assert max(outstanding) <= 1, outstanding
    assert "EM 0.500 (mean@3, pass@3 0.750) over 4 questions" in format_line(record)


def test_sampled_evaluation_needs_a_temperature(tmp_path):
    with pytest.raises(ValueError, match="eval_samples > 1 needs learner.eval_temperature"):
        load_config(None, [f"run_dir={tmp_path}", "learner.eval_samples=4"])


def test_the_group_filter_keeps_what_it_dropped_for_the_generated_metrics(
        make_loop, redis_url, namespace):
    """With algorithm.filter_groups a batch holds only groups with a spread, so its own
    reward/mean cannot show a policy getting better; the dropped groups' samples are kept until
    the step and `generated/*` counts everything played. Here synth_single groups all score 1
    (dropped) and synth_multihop groups score 1 and 0 (kept)."""
    from services.learner.batch_stats import generated_metrics

    rows = _rows(4) + _rows(4, "synth_multihop", start=4)
    loop = make_loop(train_rows=rows, **{"algorithm.filter_groups": "true", "max_staleness": 2})

    def multihop(group: PromptGroup, index: int) -> float:
        return float(index == 0) if "multihop" in group.data_source else 1.0

    with Replica(redis_url, namespace, reward=multihop):
        deadline = time.monotonic() + 20
        batch = None
        while batch is None and time.monotonic() < deadline:
            batch = loop._wait_for_batch()
    assert batch is not None
    assert {g.samples[0].trajectory.data_source for g in batch} == {"synth_multihop"}
    dropped = loop.filtered_items
    assert dropped and {i.trajectory.data_source for i in dropped} == {"synth_single"}
    assert all(i.reward == 1.0 for i in dropped)
    assert loop.ledger.accounting()["dropped_groups"] == len(dropped) // 2
    kept = [s for group in batch for s in group.samples]
    metrics = generated_metrics(kept, dropped)
    assert metrics["generated/trajectories"] == len(kept) + len(dropped)
    assert metrics["generated/filtered_trajectories"] == len(dropped)
    assert metrics["generated/em/synth_single"] == 1.0
    assert metrics["generated/n/synth_single"] == len(dropped)
    assert metrics["generated/em/synth_multihop"] == 0.5
    assert metrics["generated/reward/mean"] == pytest.approx(
        (len(dropped) + len(kept) / 2) / (len(kept) + len(dropped)))
