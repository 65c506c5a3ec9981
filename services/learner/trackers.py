"""Experiment trackers: where each train / eval metrics line and each sample table goes.

`learner.logger` names them, as verl's `trainer.logger` does: `console` (every key of the line,
verl's `step:N - key:value` form, through the learner's log), `jsonl` (RUN_DIR/metrics.jsonl,
always written: `forage report`, resume and `forage up`'s progress read it), `tensorboard`
(event files under RUN_DIR/tensorboard), `wandb` (offline under RUN_DIR/wandb unless a key or
WANDB_MODE says otherwise) and `mlflow` (a SQLite store RUN_DIR/mlflow.db with artifacts in
RUN_DIR/mlflow-artifacts, unless MLFLOW_TRACKING_URI names a server).

The libraries are optional extras (`pip install 'forage[trackers]'`), imported only when chosen:
a chosen one that is missing is a one-line `TrackerError` at start, not a crash at step 1.
`--resume` continues the same tracker run: the wandb and MLflow run ids live in
RUN_DIR/trackers.json, and TensorBoard hides the events of steps after the checkpoint
(`purge_step`), which the resumed run logs again.

A tracker that fails mid-run (a full disk, a server gone) is logged once and switched off: the
run and its metrics.jsonl go on, since a tracker is a view of the run, not its record.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from services.common.config import ConfigError
from services.common.redact import redact

log = logging.getLogger("forage.learner.trackers")
console_log = logging.getLogger("forage.learner.metrics")

TRACKERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
STATE_FILE = "trackers.json"
PROJECT = "forage"  # wandb project / MLflow experiment unless WANDB_PROJECT / MLFLOW_... say
# The JSON-line fields that are not metrics.
_NOT_METRICS = {"kind", "step", "time"}
# The pip extra and the module each optional tracker needs.
_EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
           "mlflow": ("mlflow", "mlflow")}
# Columns of the sample table every tracker receives (samples.py writes the rows).
SAMPLE_COLUMNS = ("step", "kind", "policy_version", "data_source", "question", "turns",
                  "answer", "ground_truth", "reward", "reward_components", "probe_scores",
                  "correct")
_MLFLOW_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")


class TrackerError(ConfigError):
    """A chosen tracker cannot start (not installed, unusable store); the message says which.
    A ConfigError, so `forage learner train` prints it as one line and exits 2."""


class Tracker(Protocol):
    name: str

    def log_metrics(self, metrics: Mapping[str, float], step: int, kind: str) -> None: ...

    def log_samples(self, rows: Sequence[Mapping[str, Any]], step: int, kind: str) -> None: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------- pure helpers


def numeric_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics line (bools as 0/1), without its kind/step/time fields."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in _NOT_METRICS or isinstance(value, str) or value is None:
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(number):
            out[key] = number
    return out


def console_line(metrics: Mapping[str, float], step: int, kind: str) -> str:
    """verl's console form: `step:3 - actor/pg_loss:-0.012 - ...` (keys sorted)."""
    parts = [f"{kind} step:{step}"]
    parts += [f"{key}:{value:.4g}" for key, value in sorted(metrics.items())]
    return " - ".join(parts)


def render_turns(turns: Sequence[Mapping[str, Any]]) -> str:
    """A sample's turns as plain text, one block per turn (for a table cell)."""
    blocks = []
    for index, turn in enumerate(turns, start=1):
        head = f"[{index}] {turn.get('action')}"
        if turn.get("query"):
            head += f": {turn['query']}"
        docs = turn.get("docs") or []
        if docs:
            head += "  -> " + "; ".join(f"{d.get('id')} {d.get('title')}" for d in docs)
        blocks.append(f"{head}\n{turn.get('text', '')}")
    return "\n\n".join(blocks)


def _cell(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def sample_table(rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """(columns, data) of a sample table: scalars as they are, turns as text, the rest JSON."""
    data = []
    for row in rows:
        cells = []
        for column in SAMPLE_COLUMNS:
            value = row.get(column)
            cells.append(render_turns(value or []) if column == "turns" else _cell(value))
        data.append(cells)
    return list(SAMPLE_COLUMNS), data


def mlflow_key(key: str) -> str:
    """MLflow accepts letters, digits, `_-. /` in metric names; anything else becomes `_`."""
    return _MLFLOW_KEY.sub("_", key)


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"learner": {"lr": 1e-6}}` -> `{"learner.lr": "1e-06"}`: a config as MLflow params."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = json.dumps(value, default=str)[:6000] if not isinstance(value, str) \
                else value[:6000]
    return out


def read_state(run_dir: Path) -> dict[str, Any]:
    path = run_dir / STATE_FILE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return state if isinstance(state, dict) else {}


def write_state(run_dir: Path, state: Mapping[str, Any]) -> None:
    path = run_dir / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True), encoding="utf-8")
    tmp.replace(path)


def require(name: str) -> Any:
    """Import the library of tracker `name`, or raise TrackerError saying how to install it."""
    import importlib

    extra, module = _EXTRAS[name]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TrackerError(
            f"learner.logger has {name!r} but {module!r} is not installed ({exc}); "
            f"pip install 'forage[{extra}]' (or 'forage[trackers]' for all), or remove it"
        ) from None


def check_trackers(names: Sequence[str]) -> None:
    """Fail at start, before the model loads, when a chosen tracker's library is missing."""
    for name in dict.fromkeys(names):
        if name in _EXTRAS:
            require(name)


# ---------------------------------------------------------------- trackers


class ConsoleTracker:
    name = "console"

    def log_metrics(self, metrics: Mapping[str, float], step: int, kind: str) -> None:
        console_log.info("%s", console_line(metrics, step, kind))

    def log_samples(self, rows: Sequence[Mapping[str, Any]], step: int, kind: str) -> None:
        for row in rows:
            console_log.info("%s sample @ step %d: %s -> %r (truth %s, reward %s)", kind, step,
                             str(row.get("question"))[:120], row.get("answer"),
                             _cell(row.get("ground_truth")), row.get("reward"))

    def close(self) -> None:
        pass


class TensorBoardTracker:
    """Scalars per key and the sample table as markdown text, under RUN_DIR/tensorboard."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, resumed_step: int) -> None:
        require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = run_dir / "tensorboard"
        # A resumed run re-runs the steps after its checkpoint: hide their old events.
        purge = resumed_step + 1 if resumed_step > 0 else None
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge)

    def log_metrics(self, metrics: Mapping[str, float], step: int, kind: str) -> None:
        now = time.time()
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step, walltime=now)
        self.writer.flush()

    def log_samples(self, rows: Sequence[Mapping[str, Any]], step: int, kind: str) -> None:
        columns, data = sample_table(rows)
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for cells in data:
            text = [str(c).replace("|", "\\|").replace("\n", "<br>") for c in cells]
            lines.append("| " + " | ".join(text) + " |")
        self.writer.add_text(f"samples/{kind}", "\n".join(lines), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _wandb_mode() -> str:
    """WANDB_MODE when set; otherwise online only with an API key, else offline (no network
    is needed, and `wandb sync RUN_DIR/wandb/offline-run-*` uploads later)."""
    mode = os.environ.get("WANDB_MODE")
    if mode:
        return mode
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class WandbTracker:
    name = "wandb"

    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any],
                 state: dict[str, Any], resumed_step: int) -> None:
        wandb = require("wandb")
        self.wandb = wandb
        run_id = state.get("wandb", {}).get("id") if resumed_step > 0 else None
        run_id = run_id or uuid.uuid4().hex[:8]
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", PROJECT), name=run_name, id=run_id,
            resume="allow", dir=str(run_dir), mode=_wandb_mode(), config=dict(config),
            settings=wandb.Settings(quiet=True, console="off", disable_git=True,
                                    x_disable_stats=True),
        )
        state["wandb"] = {"id": run_id, "mode": _wandb_mode()}

    def log_metrics(self, metrics: Mapping[str, float], step: int, kind: str) -> None:
        self.run.log(dict(metrics), step=step)

    def log_samples(self, rows: Sequence[Mapping[str, Any]], step: int, kind: str) -> None:
        columns, data = sample_table(rows)
        self.run.log({f"samples/{kind}": self.wandb.Table(columns=columns, data=data)},
                     step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """Metrics per step, the config as params, sample tables as JSON artifacts."""

    name = "mlflow"

    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any],
                 state: dict[str, Any], resumed_step: int) -> None:
        require("mlflow")
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(run_dir / 'mlflow.db')}"
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        try:
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment is not None else \
                self.client.create_experiment(
                    name, artifact_location=(run_dir / "mlflow-artifacts").resolve().as_uri())
            saved = state.get("mlflow", {}) if resumed_step > 0 else {}
            if saved.get("run_id") and saved.get("tracking_uri") == uri:
                self.run_id = saved["run_id"]
                self.client.update_run(self.run_id, status="RUNNING")
            else:
                run = self.client.create_run(experiment_id, run_name=run_name)
                self.run_id = run.info.run_id
                self._log_params(config)
        except Exception as exc:  # the store's own error types vary by backend
            raise TrackerError(f"mlflow store {uri} cannot be used: {exc}") from None
        state["mlflow"] = {"run_id": self.run_id, "tracking_uri": uri,
                           "experiment_id": experiment_id}

    def _log_params(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in flatten(config).items()]
        for start in range(0, len(params), 100):  # MLflow's batch limit for params
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log_metrics(self, metrics: Mapping[str, float], step: int, kind: str) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), v, now, step) for k, v in metrics.items()]
        for start in range(0, len(batch), 1000):  # MLflow's batch limit for metrics
            self.client.log_batch(self.run_id, metrics=batch[start:start + 1000])

    def log_samples(self, rows: Sequence[Mapping[str, Any]], step: int, kind: str) -> None:
        columns, data = sample_table(rows)
        # The {"columns", "data"} shape of mlflow.log_table's JSON artifact, without pandas.
        self.client.log_text(self.run_id, json.dumps({"columns": columns, "data": data},
                                                     ensure_ascii=False),
                             f"samples/{kind}_step_{step:08d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


# ---------------------------------------------------------------- the set the loop holds


class TrackerSet:
    """Every chosen tracker; one failing is logged and switched off, never raised."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.trackers]

    def _each(self, what: str, call: Any) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as exc:  # a tracker is a view of the run: the run goes on
                log.error("tracker %s failed in %s (%s: %s); switched off for the rest of the "
                          "run (metrics.jsonl is unaffected)", tracker.name, what,
                          type(exc).__name__, exc)
                self.trackers.remove(tracker)

    def log_metrics(self, record: Mapping[str, Any]) -> None:
        """One metrics line (train or eval) as written to metrics.jsonl."""
        metrics = numeric_metrics(record)
        step, kind = int(record.get("step", 0)), str(record.get("kind", "train"))
        self._each("log_metrics", lambda t: t.log_metrics(metrics, step, kind))

    def log_samples(self, rows: Sequence[Mapping[str, Any]], step: int, kind: str) -> None:
        if rows:
            self._each("log_samples", lambda t: t.log_samples(rows, step, kind))

    def close(self) -> None:
        self._each("close", lambda t: t.close())
        self.trackers = []


def open_trackers(names: Sequence[str], run_dir: str | Path, run_name: str,
                  config: Mapping[str, Any], resumed_step: int = 0) -> TrackerSet:
    """Start the trackers named in `learner.logger` (duplicates once; `jsonl` needs none).

    `resumed_step` > 0 continues the tracker runs recorded in RUN_DIR/trackers.json.
    Raises TrackerError (one line) when a chosen tracker cannot start; those already
    started are closed first.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise TrackerError(f"learner.logger: unknown tracker(s) {unknown}; known: {TRACKERS}")
    state = read_state(run_dir)
    config = redact(config)
    started: list[Tracker] = []
    try:
        for name in dict.fromkeys(names):
            if name == "console":
                started.append(ConsoleTracker())
            elif name == "tensorboard":
                started.append(TensorBoardTracker(run_dir, resumed_step))
            elif name == "wandb":
                started.append(WandbTracker(run_dir, run_name, config, state, resumed_step))
            elif name == "mlflow":
                started.append(MlflowTracker(run_dir, run_name, config, state, resumed_step))
    except BaseException:
        TrackerSet(started).close()
        raise
    write_state(run_dir, state)
    if started:
        log.info("trackers: %s", ", ".join(t.name for t in started))
    return TrackerSet(started)
