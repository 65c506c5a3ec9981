"""`forage demo --quick` end to end, fault drills on a running `forage up`, and Ctrl-C.

All on real processes: the demo's own world, index, tokenizer, SFT policy, Redis, retriever,
learner, scorer and rollout. The quick demo's output (world + SFT policy) is built once per
session and reused by the drills, which run their own `forage up` on it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import yaml

from services.common.streams import stream_key

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT),
                                                        os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="session")
def quick_demo(tmp_path_factory, redis_url):
    """`forage demo --quick`, run the way the GPU check's demo part runs it (bench/gpu/
    demo_part.py: the same command plus `--fresh --set rollout.device=cpu`, its console passed
    through), so one run checks the demo and that part's report."""
    base = tmp_path_factory.mktemp("demo")
    out, part_out = base / "run", base / "gpu-check"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "demo_part.py"),
                           "--dry-run", "--out", str(part_out), "--run-dir", str(out)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    wall = time.monotonic() - started
    return out, proc, wall


def _dump_logs(out: Path) -> str:
    parts = []
    for path in sorted((out / "logs").glob("*.log")):
        parts.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace")
                                                      .splitlines()[-25:]))
    return "\n".join(parts)


def test_quick_demo_runs_every_service_and_writes_a_report(quick_demo, redis_url):
    out, proc, wall = quick_demo
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + _dump_logs(out)
    # every service ran and logged
    for name in ("retriever", "learner", "scorer", "rollout-0"):
        assert (out / "logs" / f"{name}.log").stat().st_size > 0, name
    events = json.loads((out / "services.json").read_text())["events"]
    assert {e["service"] for e in events if e["event"] == "start"} == {
        "retriever", "learner", "scorer", "rollout-0"}
    # every service started before any was healthy: their start-ups overlap
    kinds = [e["event"] for e in events]
    assert kinds.index("healthy") > max(i for i, k in enumerate(kinds) if k == "start"), events
    # trajectories flowed through every stream of the run's namespace
    info = json.loads((out / "demo.json").read_text())
    client = redis.Redis.from_url(yaml.safe_load((out / "config.yaml").read_text())
                                  ["redis"]["url"])
    for kind in ("prompts", "rollouts", "scored"):
        groups = client.xinfo_groups(f"{info['namespace']}:{kind}")
        assert groups and groups[0]["entries-read"] > 0, kind
    # the steps ran, weights were synced at least twice, evaluation before and after
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if m["kind"] == "train"]
    evals = [m for m in lines if m["kind"] == "eval"]
    assert [m["step"] for m in train] == [1, 2, 3, 4]
    assert [m["step"] for m in evals] == [0, 4] and all(m["eval/n"] == 8 for m in evals)
    loads = (out / "logs" / "rollout-0.log").read_text().count("loaded policy version")
    assert loads >= 2
    assert any("probe_all/score_at_0.00" in m for m in train)  # the probe ran and was scored
    # the report
    summary = json.loads((out / "report" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["em_before"] is not None
    assert summary["wall_seconds"] == pytest.approx(info["wall_seconds"])
    for png in ("reward_em.png", "searches.png", "response_length.png", "probe_curve.png"):
        assert (out / "report" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "held-out EM" in proc.stdout
    # the warm start says what it reached (issue 15): measured, ungated in --quick
    warm = [line for line in proc.stdout.splitlines() if line.startswith("warm start: ")]
    assert len(warm) == 1 and "format " in warm[0] and "after 4 steps (no gate)" in warm[0], warm
    assert info["warm_start"]["stopped"] == "epochs" and info["warm_start"]["steps"] == 4
    assert [h["step"] for h in info["warm_start"]["history"]] == [4]
    stamp = json.loads((out / "prepared.json").read_text())
    assert stamp["sft"]["sft_eval_every"] == 4 and "sft_until" in stamp["sft"]
    # EM 0 -> 0 is expected at toy size: the output says so instead of looking broken
    assert "checks the plumbing at toy size" in proc.stdout and "does not learn" in proc.stdout
    assert (out / "report" / "index.html").is_file()
    # retrieval health: exactly the steps whose trajectories searched report it (the quick
    # demo's 4-step warm start seldom searches), from the real retriever (no cache, no empty
    # passages in the world's corpus); the report shows it, or says there is none
    for m in train:
        assert ("retrieval/search_turns" in m) == (m["searches/mean"] > 0), m
        if "retrieval/search_turns" in m:
            assert m["retrieval/empty_rate"] == 0 and m["retrieval/cache_hit_rate"] == 0, m
            assert 0 < m["retrieval/latency_p50_ms"] <= m["retrieval/latency_p99_ms"], m
    page = (out / "report" / "index.html").read_text()
    searched = any("retrieval/search_turns" in m for m in train)
    assert ("retrieval" in summary) == searched
    assert ("<table id=retrieval>" in page) == searched
    assert ("No retrieval health logged" in page) != searched
    assert (out / "report" / "retrieval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"quick demo wall time: {wall:.0f}s")


def test_gpu_check_demo_part_reports_the_run(quick_demo):
    out, proc, _ = quick_demo
    report = json.loads((out.parent / "gpu-check" / "demo.json").read_text())
    assert report["ok"] and report["error"] is None, report
    (result,) = report["results"]
    assert result["exit_code"] == 0 and result["steps"] == 4
    assert result["rollout_device"] == "cpu" and result["em_before"] is not None
    assert set(result["phases_s"]) >= {"world_s", "policy_s", "sft_s", "rl_s"}
    assert "--quick" in report["command"] and report["run_dir"] == str(out)


def test_eval_run_reproduces_the_runs_last_evaluation(quick_demo, tmp_path):
    """`forage eval --run` on the quick demo's run, from another directory: the latest
    checkpoint, the run's held-out questions, index and rollout settings, so the same EM over
    the same questions as the run's last in-run evaluation, and the same turns, token for
    token, as the run logged of it. (With eval's own defaults, Search-R1's top-k 3 and 500
    tokens a turn and observation, the demo's 32-token turns and 320-token responses differ.)"""
    from statistics import mean

    out, proc, _ = quick_demo
    assert proc.returncode == 0, "the quick demo failed; see its test"
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] == "eval"][-1]
    assert last["step"] == 4
    done = subprocess.run([sys.executable, "-m", "services.cli", "eval", "--run", str(out),
                           "--out", str(tmp_path / "eval")], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "not as the run evaluated" not in done.stderr
    config = json.loads((tmp_path / "eval" / "config.json").read_text())
    assert config["models"][0]["path"] == str(out / "checkpoints" / "step_00000004" / "policy")
    lines = [json.loads(line)
             for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    # the same number of questions, per data source, and the same EM
    assert len(lines) == last["eval/n"]
    for source in {line["data_source"] for line in lines}:
        mine = [line for line in lines if line["data_source"] == source]
        assert len(mine) == last[f"eval/n/{source}"], source
        assert mean(line["em"] for line in mine) == pytest.approx(last[f"eval/em/{source}"])
    assert mean(line["em"] for line in lines) == pytest.approx(last["eval/em"])
    # played as the run played them
    assert mean(line["num_searches"] for line in lines) == pytest.approx(
        last["eval/searches/mean"])
    assert mean(line["turns_count"] for line in lines) == pytest.approx(last["eval/turns/mean"])
    assert mean(line["response_tokens"] for line in lines) == pytest.approx(
        last["eval/response_length/mean"])
    # the trajectories the run logged of that evaluation, turn for turn
    logged = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    logged = [s for s in logged if s["kind"] == "eval" and s["step"] == last["step"]]
    assert logged
    by_question = {line["question"]: line for line in lines}
    for sample in logged:
        ours = by_question[sample["question"]]
        assert [t["text"] for t in ours["turns"]] == [t["text"] for t in sample["turns"]]
        assert ours["answer"] == sample["answer"] and ours["correct"] == sample["correct"]
    assert (f"the run's own evaluation at step 4: EM {last['eval/em']:.3f}, "
            f"{last['eval/n']} questions") in done.stdout
    # the same searches, so the same retrieval health as the run measured (eval's table
    # keeps the reproducible rates), or none in both
    row = json.loads((tmp_path / "eval" / "eval.json").read_text())["rows"][0]
    assert ("retrieval" in row) == ("eval/retrieval/search_turns" in last)
    if "retrieval" in row:
        table = row["retrieval"]
        assert table["search_turns"]["all"] == last["eval/retrieval/search_turns"]
        for name in ("gold_hit_rate", "empty_rate", "repeated_passage_rate",
                     "repeated_query_rate"):
            if f"eval/retrieval/{name}" in last:
                assert table[name]["all"] == pytest.approx(last[f"eval/retrieval/{name}"],
                                                           abs=1e-6), name
        assert "Retrieval health (agent rows" in (tmp_path / "eval" / "eval.md").read_text()


def _up(config: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--config", str(config)],
                            cwd=ROOT, env=_env(), stdout=log.open("w"),
                            stderr=subprocess.STDOUT)


def _drill_config(quick_demo, tmp_path: Path, rollout: dict | None = None,
                  data: dict | None = None, **learner) -> Path:
    out, proc, _ = quick_demo
    assert proc.returncode == 0, "the quick demo failed; see its test"
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    run_dir = tmp_path / "drill"
    cfg["run_dir"] = str(run_dir)
    cfg["redis"]["namespace"] = f"drill-{time.time_ns()}"
    cfg["learner"].update({"checkpoint_dir": str(run_dir / "checkpoints"), "metrics_port": 0,
                           "weight_sync_port": 0, "eval_before": False, "eval_at_end": False,
                           "save_every": 1, "group_timeout_s": 20, **learner})
    cfg["retriever"]["port"] = 0
    cfg["scorer"].update({"port": 0, "metrics_port": 0})
    cfg["redis"]["visibility_timeout_s"] = 5
    cfg["rollout"].update(rollout or {})
    cfg["data"].update(data or {})
    path = tmp_path / "drill.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _pids(run_dir: Path) -> dict[str, int]:
    try:
        return json.loads((run_dir / "services.json").read_text())["pids"]
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["kind"] == "train"]


def _wait(predicate, proc, log: Path, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"forage up exited {proc.returncode} waiting for {what}:\n"
                                 + log.read_text()[-3000:])
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-3000:]}")


def test_fault_drills(quick_demo, tmp_path):
    """Kill rollout, scorer, retriever and learner mid-run: the run completes, nothing is lost."""
    config = _drill_config(quick_demo, tmp_path, total_steps=6)
    run_dir = tmp_path / "drill"
    log = tmp_path / "up.log"
    proc = _up(config, log)
    try:
        plan = [(1, "rollout-0"), (2, "scorer"), (3, "retriever"), (4, "learner")]
        for step, victim in plan:
            _wait(lambda s=step: len(_steps(run_dir)) >= s, proc, log, 240, f"step {step}")
            pid = _pids(run_dir)[victim]
            os.kill(pid, signal.SIGKILL)
            _wait(lambda v=victim, p=pid: _pids(run_dir).get(v, p) != p, proc, log, 30,
                  f"{victim} restarted")
        assert proc.wait(timeout=400) == 0, log.read_text()[-4000:] + _dump_logs(run_dir)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if m["kind"] == "train"]
    # the steps continue from the checkpoint: 1..6 each once (a redone step replaces its line)
    assert [m["step"] for m in train] == [1, 2, 3, 4, 5, 6]
    last = train[-1]
    assert last["groups/balanced"] == 1
    assert last["groups/issued"] == (last["groups/trained"] + last["groups/dropped_groups"]
                                     + last["groups/in_flight"])
    assert "resumed from" in (run_dir / "logs" / "learner.log").read_text()
    events = json.loads((run_dir / "services.json").read_text())["events"]
    restarted = {e["service"] for e in events if e["event"] == "exit"}
    assert restarted == {"rollout-0", "scorer", "retriever", "learner"}
    # no child outlived `forage up`
    for event in events:
        if event["event"] == "start":
            assert not _alive(event["pid"]), event


def _stop_report(run_dir: Path, log: Path) -> str:
    """forage up's log and the end of every child's log (which child held the shutdown)."""
    parts = [f"--- forage up\n{log.read_text()[-3000:]}"]
    for child_log in sorted((run_dir / "logs").glob("*.log")):
        parts.append(f"--- {child_log.name}\n{child_log.read_text()[-1500:]}")
    return "\n".join(parts)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie awaiting its reaper is not running
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False


def test_ctrl_c_stops_every_child(quick_demo, tmp_path):
    config = _drill_config(quick_demo, tmp_path, total_steps=1000)
    run_dir = tmp_path / "drill"
    log = tmp_path / "up.log"
    proc = _up(config, log)
    try:
        _wait(lambda: len(_pids(run_dir)) == 4 and len(_steps(run_dir)) >= 1, proc, log, 240,
              "all four services and a first step")
        pids = _pids(run_dir)
        proc.send_signal(signal.SIGINT)
        # The supervisor's own budget: the learner 120 s, then 30 s for each other child.
        try:
            code = proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            raise AssertionError("forage up did not exit after Ctrl-C:\n"
                                 + _stop_report(run_dir, log)) from None
        assert code == 130, _stop_report(run_dir, log)
        assert "did not stop in time" not in log.read_text(), _stop_report(run_dir, log)
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.5)
    assert [name for name, pid in pids.items() if _alive(pid)] == []
    assert (run_dir / "checkpoints" / "latest").exists()  # the learner checkpointed on the way out


def _extra_replica(run_dir: Path, name: str, log: Path) -> subprocess.Popen:
    """One more `forage rollout serve` joining the running job, as a scaled-up Deployment's
    pod does: the run's own resolved config, its own name and metrics port."""
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "rollout", "serve", "--config",
         str(run_dir / "config.yaml"), "--set", f"rollout.name={name}",
         "--set", "rollout.metrics_port=0"],
        cwd=ROOT, env=_env(), stdout=log.open("w"), stderr=subprocess.STDOUT)


def _deploy_helper(name: str, file: str):
    """A helper module of tests/deploy, loaded by path (importlib mode: no shared imports)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "deploy" / file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_replicas_follow_the_shipped_autoscaling_rule_mid_run(quick_demo, tmp_path, redis_url):
    """Elastic rollout, driven by the rule Kubernetes would apply: the KEDA ScaledObject of the
    rendered manifests (deploy/k8s/rollout-keda.yaml: its formula, minimum, polling interval
    and scale-down behaviour, all durations at 1/60; its maximum raised to 3 as for a cluster
    with GPUs for 3 replicas) reads the real prompts stream of a running
    `forage up` and starts or SIGTERMs `forage rollout serve` replicas as a Deployment scaled
    by it would. An evaluation of 48 questions before the first step asks for 3 replicas; the
    training that follows (2 groups a step, within one replica's capacity) for 1, so the 2 new
    replicas are stopped mid-run once the window has passed. The run completes every step once,
    no group is lost or trained twice, the staleness bound holds, and each new replica loads
    the current weights before it plays a group."""
    keda_rule = _deploy_helper("forage_keda_rule", "keda_rule.py")
    deploy_files = _deploy_helper("forage_deploy_files", "deploy_files.py")
    (scaled,) = [o for o in deploy_files.render() if o["kind"] == "ScaledObject"]
    # as docs/deploy.md says for a cluster with GPUs for 3 rollout replicas (1 as shipped)
    scaled["spec"]["maxReplicaCount"] = 3
    steps, staleness, max_batch, n_samples = 40, 0, 4, 2
    capacity = max_batch // n_samples  # groups a replica plays at once (the worker's rule)
    out = quick_demo[0]
    train_files = yaml.safe_load((out / "config.yaml").read_text())["data"]["train_files"]
    config = _drill_config(
        quick_demo, tmp_path, total_steps=steps, max_staleness=staleness, eval_before=True,
        eval_every=0, eval_max_questions=48, eval_max_in_flight=0,
        rollout={"max_batch_size": max_batch},
        data={"n_samples": n_samples, "test_files": train_files, "max_test_items": 48})
    cfg = yaml.safe_load(config.read_text())
    key = stream_key(cfg["redis"]["namespace"], "prompts")
    client = redis.Redis.from_url(redis_url)
    scaler = keda_rule.Autoscaler(scaled, replicas=1, time_scale=1 / 60, target=capacity)
    run_dir = tmp_path / "drill"
    log = tmp_path / "up.log"
    proc = _up(config, log)
    started: list[tuple[str, subprocess.Popen, Path]] = []
    running: list[tuple[str, subprocess.Popen, Path]] = []
    polls: list[tuple[float, dict[str, int], int]] = []
    stopped_at_step: list[int] = []
    t0 = time.monotonic()
    try:
        while proc.poll() is None and time.monotonic() - t0 < 400:
            try:
                metrics = keda_rule.trigger_metrics(client, scaled, key)
            except redis.ResponseError:  # the stream or group does not exist yet
                metrics = {t["name"]: 0 for t in scaled["spec"]["triggers"]}
            wanted = scaler.poll(time.monotonic() - t0, metrics)
            polls.append((round(time.monotonic() - t0, 1), metrics, wanted))
            while 1 + len(running) < wanted:  # rollout-0 is forage up's own replica
                name = f"extra-{len(started) + 1}"
                extra_log = tmp_path / f"{name}.log"
                started.append((name, _extra_replica(run_dir, name, extra_log), extra_log))
                running.append(started[-1])
            while 1 + len(running) > wanted:  # a scale-down removes the newest pod
                _, replica, _ = running.pop()
                replica.send_signal(signal.SIGTERM)
                stopped_at_step.append(len(_steps(run_dir)))
            if started and not running and scaler.replicas == 1:
                break  # scaled up and back down: let the run finish
            time.sleep(scaler.polling_s)
        trace = "\n".join(map(str, polls[-40:]))
        assert len(started) == 2, f"the rule never asked for 3 replicas:\n{trace}"
        assert not running, f"the rule never scaled back down before the run ended:\n{trace}"
        for _, replica, extra_log in started:
            assert replica.wait(timeout=120) == 0, extra_log.read_text()[-3000:]
        assert max(stopped_at_step) < steps, "the run ended before the scale-down"
        assert proc.wait(timeout=400) == 0, log.read_text()[-4000:] + _dump_logs(run_dir)
    finally:
        for _, replica, _ in started:
            if replica.poll() is None:
                replica.kill()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
    played = 0
    for name, _, extra_log in started:
        text = extra_log.read_text()
        assert "loaded policy version" in text, name
        if "played" in text:
            played += 1
            assert text.index("loaded policy version") < text.index("played"), name
        assert f"replica {name} stopped" in text, text[-2000:]
    assert played >= 1, "no new replica played a group before the scale-down"
    train = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert [m["step"] for m in train] == list(range(1, steps + 1))  # each step once
    last = train[-1]
    assert last["groups/dropped_groups"] == 0                      # no group lost
    assert last["groups/balanced"] == 1 and last["groups/issued"] == (
        last["groups/trained"] + last["groups/dropped_groups"] + last["groups/in_flight"])
    assert last["groups/trained"] == steps * 2                      # train_batch_size 2, once each
    assert max(m["staleness/max"] for m in train) <= staleness
