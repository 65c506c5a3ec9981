"""Control-plane scaling: trajectories/s with N = 1, 4, 16, 64 rollout replicas on one machine.

What runs, per N, against one private Redis (a fresh stream namespace each time):

- the learner: Forage's `LearnerLoop` in its own process (prompt issue and admission control,
  the group ledger, reading and acking the scored stream, batching, GRPO advantages, weight
  publication through the real WeightSync server, the metrics line) with its training step
  simulated (`SimTrainer`: the optimizer step is a `--train-s` sleep and the published weights
  are the tiny policy's, unchanged). Why: on 2 CPU cores the real tiny-policy step costs the
  learner 36-53 ms of CPU per trajectory, 10 to 40 times the loop's own bookkeeping, and grows
  with the batch, so at N = 64 (128 groups a step) it alone would set the ceiling and the bench
  would measure PyTorch, not the control plane. `--trainer real` runs `forage learner train`
  instead, to see that ceiling;
- the scorer: `forage scorer serve`, unchanged (rule rewards for the `nq` data source);
- N rollout replicas: `services.rollout.worker.RolloutWorker`, unchanged, each with its own
  Redis connections, consumer name, heartbeat key, lease thread and WeightSync client, run as
  threads in `--hosts` processes (bench/sim_engine.py, `ReplicaHost`), each on a
  `SimulatedEngine` whose generation takes `--per-token-ms` of wall time per token (sleep) and
  returns real token ids of a well-formed Search-R1 answer `--answer-rate` of the time (else an
  invalid turn and another one). No retriever: the simulated policy never searches.

The batch grows with N (weak scaling): each replica holds `--groups-per-replica` groups of
`--group-size` samples (its `max_batch_size`), and a step trains N × that many groups, with
`max_staleness` 1, so admission control keeps twice a step's groups in flight and no replica
waits for work when the control plane keeps up. One replica's throughput is then bounded by
its simulated engine alone; N replicas' by N times that, unless Forage's overhead (Redis round
trips, the scorer, the learner's bookkeeping, GIL and CPU on this machine) holds them back.

Measured between the learner's `--warmup` step and its last step (start-up excluded), from
metrics.jsonl: trajectories trained per second; Redis commands per trajectory (INFO
commandstats before and after, the bench's own INFO calls excluded); the learner process's CPU
seconds per step (psutil); CPU seconds of the scorer, the replica hosts and Redis per
trajectory; "engine busy", the share of the engines' slot time spent on tokens that were
trained; and trajectories dropped by the staleness bound. With FORAGE_BENCH_PROFILE_DIR set,
each replica host writes a cProfile (thread CPU time) of its replicas there.

    .venv/bin/python bench/scale.py                       # N = 1,4,16,64, ~2-3 minutes
    .venv/bin/python bench/scale.py --quick               # N = 1,4, 3 steps, about a minute
    .venv/bin/python bench/scale.py --counts 1,8 --per-token-ms 20 --group-size 8

The last line is `ratio: throughput(N=16) / (16 × throughput(N=1))` (target ≥ 0.8, and the same
at N = 64; the table prints "× linear" for every N).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

ROWS = 512  # training prompts (uids are unique per issue, rows repeat)
EXCLUDED_COMMANDS = {"info", "config|resetstat", "config", "ping", "client|setname"}


# ---------------------------------------------------------------------- inputs


def prepare(out: Path) -> tuple[Path, Path]:
    """A Search-R1-style training set (ground truths drawn from the simulated engine's answers)
    and the tiny policy for it, built once under `out` and reused."""
    from sim_engine import ANSWERS

    from services.common.formats import search_r1_prompt

    data, model = out / "data", out / "model"
    train = data / "train.parquet"
    if not train.exists():
        from services.tasks.datasets import write_rows

        rows = [{
            "data_source": "nq",
            "prompt": [{"role": "user", "content": search_r1_prompt(
                f"which town hosts the lantern fair of district {i}?")}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule",
                             "ground_truth": {"target": [ANSWERS[i % len(ANSWERS)]]}},
            "extra_info": {"index": i},
        } for i in range(ROWS)]
        write_rows(train, rows)
    if not (model / "config.json").exists():
        from services.tasks.cli_model import init_policy

        print(f"building the tiny policy in {model}", flush=True)
        init_policy(data, model, preset="tiny")
    return train, model


@dataclass
class Settings:
    per_token_ms: float
    tokens_per_turn: int
    answer_rate: float
    group_size: int
    groups_per_replica: int
    warmup: int
    steps: int
    hosts: int
    trainer: str
    train_s: float
    step_ms: float


def run_config(out: Path, n: int, s: Settings, redis_url: str, train: Path, model: Path,
               extra: list[str]) -> Any:
    from services.common.config import load_config
    from services.common.ports import free_port

    run_dir = out / f"n{n}"
    overrides = [
        f"run_id=scale-n{n}", f"run_dir={run_dir}",
        f"redis.url={redis_url}", f"redis.namespace=scale-n{n}-{time.time_ns()}",
        f"model.path={model}", f"data.train_files=[{train}]", "data.test_files=[]",
        f"data.n_samples={s.group_size}",
        f"rollout.max_batch_size={s.group_size * s.groups_per_replica}",
        "rollout.max_turns=2", f"rollout.max_tokens_per_turn={s.tokens_per_turn + 16}",
        "rollout.max_response_length=512", "rollout.max_prompt_length=512",
        f"learner.train_batch_size={n * s.groups_per_replica}", "learner.max_staleness=1",
        f"learner.total_steps={s.warmup + s.steps}", "learner.save_every=100000",
        "learner.eval_before=false", "learner.eval_at_end=false",
        f"learner.checkpoint_dir={run_dir / 'checkpoints'}",
        f"learner.weight_sync_port={free_port()}", f"learner.metrics_port={free_port()}",
        "learner.group_timeout_s=300", "learner.micro_batch_tokens=4096",
        "scorer.num_workers=1", "scorer.http=false", f"scorer.metrics_port={free_port()}",
        *extra,
    ]
    return load_config(None, overrides, environ={})


# ---------------------------------------------------------------------- child roles


class SimTrainer:
    """The learner's trainer with the tensor work left out (see the module docstring): the
    loop's calls keep their shapes, the published weights are the tiny policy's."""

    lora = None
    ref = None
    critic = None

    def __init__(self, model_path: str, train_s: float) -> None:
        from safetensors.torch import load_file

        self.train_s = train_s
        self.max_response_length = 0
        self._weights = load_file(str(Path(model_path) / "model.safetensors"))

    def state_dict_for_export(self, keep: bool = True) -> dict[str, Any]:
        return self._weights

    def rl_step(self, samples: list[Any]) -> dict[str, float]:
        if self.train_s > 0:
            time.sleep(self.train_s)
        return {"pg_loss": 0.0, "tokens": float(sum(len(sample) for sample in samples))}

    def compute_log_probs(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("SimTrainer: the bench's GRPO settings need no extra log-prob pass")


def run_learner(config_path: str, train_s: float) -> int:
    """The real learner loop with `SimTrainer` in place of the DeepSpeed trainer."""
    from services.common.config import load_config
    from services.common.logs import setup_logging
    from services.common.threads import apply_thread_policy

    apply_thread_policy()
    cfg = load_config(config_path)
    setup_logging("learner", run_id=cfg.run_id, level=cfg.log_level)
    from transformers import AutoTokenizer

    from services.common.paths import LOCAL_ONLY
    from services.learner.loop import LearnerLoop

    class SimTrainLearner(LearnerLoop):
        def _build_trainer(self) -> None:
            self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.path, **LOCAL_ONLY)
            self.trainer = SimTrainer(self.cfg.model.path, train_s)
            self.trainer.max_response_length = self.cfg.rollout.max_response_length
            self.bnpo_state = None
            self.kl_controller = None

        def _save(self) -> None:
            """Checkpoints are the trainer's (there is none to save)."""
            self.last_saved_step = self.state.step

    return SimTrainLearner(cfg).run()


def run_replicas(config_path: str, count: int, first: int, s: argparse.Namespace) -> int:
    """`count` rollout replicas as threads of this process, until SIGTERM."""
    from services.common.config import load_config
    from services.common.logs import setup_logging
    from services.common.threads import apply_thread_policy

    apply_thread_policy()
    cfg = load_config(config_path)
    setup_logging("rollout", run_id=cfg.run_id, level="WARNING")
    from sim_engine import ReplicaHost

    host = ReplicaHost(cfg, count, first, per_token_s=s.per_token_ms / 1000.0,
                       tokens_per_turn=s.tokens_per_turn, answer_rate=s.answer_rate,
                       step_s=s.step_ms / 1000.0,
                       profile_path=os.environ.get("FORAGE_BENCH_PROFILE_DIR", "") and str(
                           Path(os.environ["FORAGE_BENCH_PROFILE_DIR"]) / f"replicas-{first}.prof"))
    stop = {"now": False}

    def on_signal(signum: int, frame: Any) -> None:
        stop["now"] = True
        host.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    host.start()
    while not stop["now"] and host.alive() == len(host.workers):
        time.sleep(0.2)
    host.stop()
    host.join(30.0)
    host.dump_profile()
    for failure in host.failures:
        print(f"replica failed: {failure}", file=sys.stderr)
    return 1 if host.failures else 0


# ---------------------------------------------------------------------- the driver


@dataclass
class Result:
    n: int
    trajectories: int
    seconds: float
    commands: dict[str, int]
    learner_cpu_s: float
    scorer_cpu_s: float
    replicas_cpu_s: float
    redis_cpu_s: float
    steps: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.trajectories / max(self.seconds, 1e-9)

    @property
    def commands_per_trajectory(self) -> float:
        return sum(self.commands.values()) / max(self.trajectories, 1)


def command_calls(client: Any) -> dict[str, int]:
    stats = client.info("commandstats")
    calls = {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}
    return {k: v for k, v in calls.items() if k not in EXCLUDED_COMMANDS}


def redis_cpu(client: Any) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def cpu_of(procs: list[Any]) -> float:
    total = 0.0
    for proc in procs:
        times = proc.cpu_times()
        total += times.user + times.system + times.children_user + times.children_system
    return total


def train_lines(metrics: Path) -> list[dict[str, Any]]:
    if not metrics.exists():
        return []
    lines = []
    for raw in metrics.read_text().splitlines():
        try:
            record = json.loads(raw)
        except ValueError:
            continue  # a line being written
        if record.get("kind") == "train":
            lines.append(record)
    return lines


def tail(path: Path, lines: int = 25) -> str:
    if not path.exists():
        return f"({path} not written)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run_one(out: Path, n: int, s: Settings, redis_client: Any, redis_url: str, train: Path,
            model: Path, args: argparse.Namespace, timeout_s: float) -> Result:
    import psutil

    from services.launch.supervisor import forage_argv
    from services.launch.up import secrets_environ, write_config

    cfg = run_config(out, n, s, redis_url, train, model, args.overrides)
    run_dir = Path(cfg.run_dir)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    config_path = write_config(cfg, run_dir / "config.yaml")
    # config.yaml has its secrets redacted: the services get them in the environment
    env = dict(os.environ, PYTHONPATH=str(REPO), FORAGE_THREADS="1", REDIS_URL=redis_url,
               **secrets_environ(cfg))
    here = [sys.executable, str(Path(__file__).resolve())]
    common = ["--config", str(config_path)]
    specs: list[tuple[str, list[str]]] = []
    if s.trainer == "real":
        specs.append(("learner", forage_argv("learner", "train", *common)))
    else:
        specs.append(("learner", [*here, "--role", "learner", *common,
                                  "--train-s", str(s.train_s)]))
    specs.append(("scorer", forage_argv("scorer", "serve", *common)))
    hosts = max(1, min(s.hosts, n))
    first = 0
    for h in range(hosts):
        count = n // hosts + (1 if h < n % hosts else 0)
        specs.append((f"replicas-{h}", [
            *here, "--role", "replicas", *common, "--count", str(count), "--first", str(first),
            "--per-token-ms", str(s.per_token_ms), "--tokens-per-turn", str(s.tokens_per_turn),
            "--answer-rate", str(s.answer_rate), "--step-ms", str(s.step_ms)]))
        first += count
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}
    try:
        for name, argv in specs:
            logs[name] = run_dir / f"{name}.log"
            with logs[name].open("w") as fh:
                procs[name] = subprocess.Popen(argv, cwd=REPO, env=env, stdout=fh,
                                               stderr=subprocess.STDOUT)
        watched = {name: psutil.Process(p.pid) for name, p in procs.items()}
        metrics = run_dir / "metrics.jsonl"
        started = time.monotonic()
        mark: dict[str, Any] | None = None
        last = s.warmup + s.steps
        while True:
            for name, proc in procs.items():
                code = proc.poll()
                if code is not None and not (name == "learner" and code == 0):
                    raise SystemExit(f"N={n}: {name} exited with {code} before the last step; "
                                     f"its log ({logs[name]}):\n{tail(logs[name])}")
            lines = train_lines(metrics)
            done = [x for x in lines if x["step"] <= last]
            if mark is None and any(x["step"] == s.warmup for x in lines):
                mark = {"commands": command_calls(redis_client),
                        "redis_cpu": redis_cpu(redis_client),
                        "learner": cpu_of([watched["learner"]]),
                        "scorer": cpu_of([watched["scorer"]]),
                        "replicas": cpu_of([p for k, p in watched.items()
                                            if k.startswith("replicas")])}
            if mark is not None and any(x["step"] == last for x in done):
                commands = command_calls(redis_client)
                end = {"redis_cpu": redis_cpu(redis_client),
                       "learner": cpu_of([watched["learner"]]),
                       "scorer": cpu_of([watched["scorer"]]),
                       "replicas": cpu_of([p for k, p in watched.items()
                                           if k.startswith("replicas")])}
                break
            if time.monotonic() - started > timeout_s:
                raise SystemExit(f"N={n}: the learner reached step "
                                 f"{max([x['step'] for x in lines], default=0)} of {last} in "
                                 f"{timeout_s:.0f}s; logs in {run_dir}:\n"
                                 f"{tail(logs['learner'])}")
            time.sleep(0.05)
        by_step = {x["step"]: x for x in done}
        window = [by_step[k] for k in range(s.warmup + 1, last + 1)]
        trajectories = int(sum(x.get("throughput/trajectories", 0) for x in window))
        seconds = by_step[last]["elapsed_s"] - by_step[s.warmup]["elapsed_s"]
        delta = {k: v - mark["commands"].get(k, 0) for k, v in commands.items()}
        delta = {k: v for k, v in delta.items() if v > 0}
        staleness = [x.get("staleness/mean") for x in window if x.get("staleness/mean") is not None]
        # Policy tokens of the trajectories trained, over the engines' slot time in the window:
        # how busy the simulated engines were with work that reached the learner.
        tokens = sum(x.get("policy_tokens/mean", 0.0) * x.get("throughput/trajectories", 0)
                     for x in window)
        slots = n * cfg.rollout.max_batch_size * seconds
        stale = (by_step[last].get("groups/dropped_stale", 0)
                 - by_step[s.warmup].get("groups/dropped_stale", 0))
        return Result(
            n=n, trajectories=trajectories, seconds=seconds, commands=delta,
            learner_cpu_s=end["learner"] - mark["learner"],
            scorer_cpu_s=end["scorer"] - mark["scorer"],
            replicas_cpu_s=end["replicas"] - mark["replicas"],
            redis_cpu_s=end["redis_cpu"] - mark["redis_cpu"], steps=s.steps,
            extra={"staleness": sum(staleness) / len(staleness) if staleness else None,
                   "wait_s": sum(x.get("timing/wait_s", 0.0) for x in window) / len(window),
                   "reward": sum(x.get("reward/mean", 0.0) for x in window) / len(window),
                   "engine_busy": tokens * s.per_token_ms / 1000.0 / max(slots, 1e-9),
                   "dropped_stale": stale})
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def report(results: list[Result], base: float) -> None:
    print()
    print("| N | trajectories/s | × linear | Redis commands / trajectory | learner CPU / step "
          "| CPU ms / trajectory: learner, scorer, replicas, Redis | engine busy "
          "| staleness | dropped stale |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        per = 1000.0 / max(r.trajectories, 1)
        stale = r.extra.get("staleness")
        print(f"| {r.n} | {r.rate:.1f} | {r.rate / (r.n * base):.2f} | "
              f"{r.commands_per_trajectory:.1f} | {r.learner_cpu_s / r.steps * 1000:.0f} ms | "
              f"{r.learner_cpu_s * per:.2f}, {r.scorer_cpu_s * per:.2f}, "
              f"{r.replicas_cpu_s * per:.2f}, {r.redis_cpu_s * per:.2f} | "
              f"{100 * r.extra['engine_busy']:.0f}% | "
              f"{'-' if stale is None else f'{stale:.2f}'} | {r.extra['dropped_stale']} |")
    print()
    for r in results:
        top = sorted(r.commands.items(), key=lambda kv: -kv[1])[:8]
        print(f"N={r.n} Redis commands per trajectory: " + ", ".join(
            f"{k} {v / max(r.trajectories, 1):.2f}" for k, v in top))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--counts", default="1,4,16,64", help="replica counts N")
    parser.add_argument("--quick", action="store_true", help="N = 1,4, 3 steps (~1 minute)")
    parser.add_argument("--out", default="runs/bench-scale")
    parser.add_argument("--per-token-ms", type=float, default=20.0,
                        help="simulated decode time per token (wall time)")
    parser.add_argument("--tokens-per-turn", type=int, default=48)
    parser.add_argument("--answer-rate", type=float, default=0.8,
                        help="share of turns that are a well-formed answer")
    parser.add_argument("--group-size", type=int, default=4, help="samples per prompt group")
    parser.add_argument("--groups-per-replica", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2, help="steps before the window")
    parser.add_argument("--steps", type=int, default=8, help="steps measured")
    parser.add_argument("--hosts", type=int, default=2,
                        help="processes the replicas' threads are spread over")
    parser.add_argument("--trainer", choices=["sim", "real"], default="sim")
    parser.add_argument("--train-s", type=float, default=0.0,
                        help="SimTrainer's step time (sleep)")
    parser.add_argument("--step-ms", type=float, default=50.0,
                        help="longest simulated engine step (between-steps work cadence)")
    parser.add_argument("--timeout-s", type=float, default=240.0, help="per N")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a run-config key for every N")
    # child roles (the driver starts them)
    parser.add_argument("--role", choices=["driver", "learner", "replicas"], default="driver",
                        help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "learner":
        sys.exit(run_learner(args.config, args.train_s))
    if args.role == "replicas":
        sys.exit(run_replicas(args.config, args.count, args.first, args))

    if args.quick:
        args.counts, args.warmup, args.steps = "1,4", 1, 3
    counts = [int(x) for x in args.counts.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        parser.error("--counts: positive integers, e.g. 1,4,16,64")
    settings = Settings(args.per_token_ms, args.tokens_per_turn, args.answer_rate,
                        args.group_size, args.groups_per_replica, args.warmup, args.steps,
                        args.hosts, args.trainer, args.train_s, args.step_ms)
    if settings.warmup < 1 or settings.steps < 1:
        parser.error("--warmup and --steps must be at least 1")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    train, model = prepare(out)

    import redis

    from services.common.redis_server import start_embedded_redis

    server = start_embedded_redis()  # private: its command counts are this bench's alone
    client = redis.Redis.from_url(server.url)
    results: list[Result] = []
    print(f"Redis {client.info('server')['redis_version']} at {server.url}; per token "
          f"{settings.per_token_ms} ms, ~{settings.tokens_per_turn} tokens a turn, answer rate "
          f"{settings.answer_rate}, {settings.groups_per_replica} groups × "
          f"{settings.group_size} samples per replica, trainer {settings.trainer}", flush=True)
    try:
        for n in counts:
            result = run_one(out, n, settings, client, server.url, train, model, args,
                             args.timeout_s)
            results.append(result)
            print(f"N={n}: {result.rate:.1f} trajectories/s ({result.trajectories} in "
                  f"{result.seconds:.1f}s over {result.steps} steps), "
                  f"{result.commands_per_trajectory:.1f} Redis commands/trajectory, learner "
                  f"CPU {result.learner_cpu_s / result.steps * 1000:.0f} ms/step", flush=True)
    finally:
        client.close()
        server.stop()
    base = next((r.rate for r in results if r.n == 1), None)
    if base is None:
        raise SystemExit("the ratio needs N=1 in --counts")
    report(results, base)
    (out / "scale.json").write_text(json.dumps([{
        "n": r.n, "trajectories": r.trajectories, "seconds": r.seconds, "rate": r.rate,
        "linear": r.rate / (r.n * base), "commands_per_trajectory": r.commands_per_trajectory,
        "commands": r.commands, "learner_cpu_per_step_s": r.learner_cpu_s / r.steps,
        "scorer_cpu_s": r.scorer_cpu_s, "replicas_cpu_s": r.replicas_cpu_s,
        "redis_cpu_s": r.redis_cpu_s, **r.extra} for r in results], indent=1) + "\n")
    ref = 16 if any(r.n == 16 for r in results) else max(r.n for r in results)
    at = next(r for r in results if r.n == ref)
    if ref != 16:
        print(f"(no N=16 in --counts: the ratio below is for N={ref})")
    print(f"ratio: {at.rate / (ref * base):.2f}")


if __name__ == "__main__":
    main()
