"""`forage eval --run RUN_DIR`: a run's checkpoint evaluated the way the run evaluated it.

The learner's own evaluation (services/learner/loop.py, `_evaluate`) asks the rows of
`data.test_files` (the first `data.max_test_items` of them, then at most
`learner.eval_max_questions` picked by `prompts.eval_subset`) through the rollout replicas,
which play them with the run's agent-loop settings (`rollout.*`, `retriever.topk`) greedily, or
at `learner.eval_temperature`, and search the run's index (`retriever.index_dir`). `RunInfo`
reads exactly those keys from RUN_DIR/config.yaml and hands them to `forage eval` as its
defaults; a flag given on the command line still wins.

Only the keys listed in `RUN_KEYS` are read, and the config is never passed through
`load_config`: the saved config holds `***` where a secret was (services/common/redact.py),
which `load_config` rightly refuses, and evaluation needs none of them.

`differences` lists the settings of an evaluation that differ from the run's: `forage eval`
prints them when `--model` is a checkpoint of a run (RUN_DIR/checkpoints/step_N/policy), so a
user comparing with the run's own numbers sees why they may differ.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RUN_CONFIG = "config.yaml"
STEP_DIR = re.compile(r"^step_(\d+)$")
LATEST = "latest"  # the checkpoint directory's marker (services/learner/checkpoint.py)

# The keys of a run's config that `forage eval --run` reads (nothing else is looked at).
RUN_KEYS: dict[str, tuple[str, ...]] = {
    "": ("run_dir",),
    "retriever": ("topk", "index_dir", "query_dtype", "nprobe", "ef_search", "k_factor"),
    "rollout": ("engine", "device", "dtype", "max_turns", "max_tokens_per_turn",
                "max_obs_length", "max_response_length", "max_prompt_length", "stop_strings",
                "protocol", "use_search"),
    "learner": ("checkpoint_dir", "eval_max_questions", "eval_samples", "eval_temperature"),
    "data": ("test_files", "max_test_items"),
    "model": ("path",),
}

# EvalSettings field -> (the run's config key, the forage eval flag that sets it).
SETTING_KEYS: dict[str, tuple[str, str | None]] = {
    "topk": ("retriever.topk", "--topk"),
    "max_turns": ("rollout.max_turns", "--max-turns"),
    "max_tokens_per_turn": ("rollout.max_tokens_per_turn", "--max-tokens-per-turn"),
    "max_obs_length": ("rollout.max_obs_length", "--max-obs-length"),
    "max_response_length": ("rollout.max_response_length", "--max-response-length"),
    "max_prompt_length": ("rollout.max_prompt_length", "--max-prompt-length"),
    "temperature": ("learner.eval_temperature", "--temperature"),
    "protocol": ("rollout.protocol", "--protocol"),
    "stop_strings": ("rollout.stop_strings", None),
}
# The run's search overrides (retriever.*): they change what a dense index returns.
SEARCH_KEYS = ("nprobe", "ef_search", "k_factor")


class RunError(ValueError):
    """A run directory `forage eval --run` cannot use; the message names the path or key."""


def _pick(raw: dict[str, Any]) -> dict[str, Any]:
    """Only RUN_KEYS of the saved config (a redacted secret is never among them)."""
    picked: dict[str, Any] = {}
    for section, keys in RUN_KEYS.items():
        source = raw if not section else raw.get(section)
        if not isinstance(source, dict):
            continue
        values = {key: source[key] for key in keys if key in source}
        if section:
            picked[section] = values
        else:
            picked.update(values)
    return picked


def _show(value: Any) -> str:
    if isinstance(value, list | tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


@dataclass(frozen=True)
class RunInfo:
    """What a run's config says about how it evaluated (RUN_KEYS only)."""

    run_dir: Path
    config: Any  # a RunConfig holding RUN_KEYS, every other key at its default

    @classmethod
    def read(cls, run_dir: str | Path) -> RunInfo:
        from pydantic import ValidationError

        from services.common.config import ConfigError, RunConfig, read_config_file

        path = Path(run_dir)
        if not path.is_dir():
            raise RunError(f"--run {run_dir}: no such directory (a run directory, with the "
                           f"{RUN_CONFIG} `forage up` or `forage demo` wrote)")
        config_file = path / RUN_CONFIG
        if not config_file.is_file():
            raise RunError(f"--run {run_dir}: no {RUN_CONFIG} in it (`forage up` and `forage "
                           "demo` write the run's config there)")
        try:
            raw = read_config_file(config_file)
        except ConfigError as exc:
            raise RunError(f"--run {run_dir}: {exc}") from None
        try:
            config = RunConfig.model_validate(_pick(raw))
        except ValidationError as exc:
            first = exc.errors()[0]
            key = ".".join(str(part) for part in first["loc"])
            raise RunError(f"--run {run_dir}: {config_file} {key}: {first['msg']}") from None
        return cls(path, config)

    @property
    def config_file(self) -> Path:
        return self.run_dir / RUN_CONFIG

    def value(self, dotted: str) -> Any:
        node: Any = self.config
        for part in dotted.split("."):
            node = getattr(node, part)
        return node

    def settings(self) -> dict[str, Any]:
        """EvalSettings field -> the run's value (its evaluation's temperature included)."""
        out = {field: self.value(key) for field, (key, _) in SETTING_KEYS.items()}
        out["stop_strings"] = tuple(out["stop_strings"])
        return out

    def search_params(self) -> dict[str, int]:
        """The run's non-null search overrides (nprobe, ef_search, k_factor)."""
        retriever = self.config.retriever
        return {key: getattr(retriever, key) for key in SEARCH_KEYS
                if getattr(retriever, key) is not None}

    # ------------------------------------------------------------------ paths

    def bases(self) -> list[Path]:
        """Where a relative path of the config is looked up: the current directory, the
        directory `forage` ran in (the config's relative `run_dir` taken off the run
        directory's path), then the run directory's parent."""
        here = self.run_dir.resolve()
        found = [Path.cwd()]
        configured = Path(self.config.run_dir)
        parts = [p for p in configured.parts if p not in (".", "")]
        if not configured.is_absolute() and parts and list(here.parts[-len(parts):]) == parts:
            found.append(Path(*here.parts[:-len(parts)]))
        found.append(here.parent)
        return list(dict.fromkeys(p.resolve() for p in found))

    def find(self, value: str, key: str, flag: str) -> Path:
        """`value` of `key` as a path that exists; RunError naming it (and the flag that
        replaces it) otherwise."""
        path = Path(value).expanduser()
        candidates = [path] if path.is_absolute() else [base / path for base in self.bases()]
        for candidate in candidates:
            if candidate.exists():
                return candidate
        where = ("" if path.is_absolute() else
                 " (looked in " + ", ".join(str(b) for b in self.bases()) + ")")
        raise RunError(f"--run {self.run_dir}: {key} {value} does not exist{where}; pass "
                       f"{flag}")

    def test_files(self) -> list[str]:
        files = self.config.data.test_files
        if not files:
            raise RunError(f"--run {self.run_dir}: data.test_files is empty in "
                           f"{self.config_file} (the run did not evaluate); pass --data FILE")
        return [str(self.find(f, f"data.test_files[{i}]", "--data FILE"))
                for i, f in enumerate(files)]

    def index_dir(self) -> str | None:
        index = self.config.retriever.index_dir
        return str(self.find(index, "retriever.index_dir", "--index DIR")) if index else None

    def checkpoint_dirs(self) -> list[Path]:
        """RUN_DIR/checkpoints, then learner.checkpoint_dir when it names another."""
        dirs = [self.run_dir / "checkpoints"]
        configured = self.config.learner.checkpoint_dir
        if configured:
            path = Path(configured)
            dirs += [path] if path.is_absolute() else [b / path for b in self.bases()]
        return list(dict.fromkeys(dirs))

    def checkpoint(self, step: int | None) -> tuple[int, Path]:
        """(step, policy directory) of the latest checkpoint, or of `step`. Step 0 is the
        policy the run started from (model.path), which its `eval_before` evaluated."""
        found: dict[int, Path] = {}
        latest: int | None = None
        for directory in self.checkpoint_dirs():
            if not directory.is_dir():
                continue
            for child in directory.iterdir():
                match = STEP_DIR.match(child.name)
                if match and (child / "policy" / "config.json").is_file():
                    found.setdefault(int(match.group(1)), child / "policy")
            marker = directory / LATEST
            if latest is None and marker.is_file():
                match = STEP_DIR.match(marker.read_text().strip())
                if match and int(match.group(1)) in found:
                    latest = int(match.group(1))
        if step is None:
            if not found:
                raise RunError(f"--run {self.run_dir}: no checkpoint (looked in "
                               f"{', '.join(str(d) for d in self.checkpoint_dirs())}); "
                               "pass --model DIR or --step 0 (the starting policy)")
            step = latest if latest is not None else max(found)
            return step, found[step]
        if step in found:
            return step, found[step]
        if step == 0:
            return 0, self.find(self.config.model.path, "model.path", "--model DIR")
        have = ", ".join(str(s) for s in sorted(found)) or "none"
        raise RunError(f"--run {self.run_dir}: no checkpoint of step {step} (steps saved: "
                       f"{have}; 0 is the starting policy)")

    # ------------------------------------------------------------------ its evaluations

    def evaluations(self) -> dict[int, dict[str, Any]]:
        """The run's `eval` lines of metrics.jsonl, by step (the last one of a step)."""
        path = self.run_dir / "metrics.jsonl"
        out: dict[int, dict[str, Any]] = {}
        if not path.is_file():
            return out
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("kind") == "eval":
                out[int(record.get("step", -1))] = record
        return out


def select_questions(questions: Sequence[Any], first: int | None, cap: int) -> list[Any]:
    """The questions the learner's evaluation asks: the first `first` rows (data.max_test_items),
    then `eval_subset`'s pick of at most `cap` (learner.eval_max_questions)."""
    from services.learner.prompts import eval_subset

    rows = list(questions[:first] if first is not None else questions)
    chosen = eval_subset([{"data_source": q.data_source} for q in rows], cap)
    return [rows[i] for i in chosen]


def run_of_model(model: str) -> RunInfo | None:
    """The run a `--model` directory is a checkpoint of (RUN_DIR/checkpoints/step_N/policy
    with RUN_DIR/config.yaml), else None; a run config it cannot read counts as none."""
    path = Path(model).resolve()
    if path.name != "policy" or not STEP_DIR.match(path.parent.name):
        return None
    run_dir = path.parent.parent.parent
    if path.parent.parent.name != "checkpoints" or not (run_dir / RUN_CONFIG).is_file():
        return None
    try:
        return RunInfo.read(run_dir)
    except RunError:
        return None


def _same_path(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a == b
    return Path(a).resolve() == Path(b).resolve()


def _same_dtype(ours: str, theirs: str, device: str) -> bool:
    """`auto` loads float32 on the CPU (services/rollout/transformers_engine.py)."""
    if ours == theirs:
        return True
    return {ours, theirs} == {"auto", "float32"} and device == "cpu"


def differences(run: RunInfo, settings: Any, *, data: Iterable[str], index: str | None,
                retriever_url: str | None, limit: int | None, run_questions: bool,
                engine: str, device: str, dtype: str, query_dtype: str,
                search_params: dict[str, Any]) -> list[str]:
    """One line per setting of this evaluation that is not what the run's evaluation used:
    `NAME: VALUE here, VALUE in the run (KEY)`."""
    lines = []
    theirs = run.settings()
    for field, (key, flag) in SETTING_KEYS.items():
        ours = getattr(settings, field)
        if field == "stop_strings":
            ours = tuple(ours)
        if ours != theirs[field]:
            lines.append(f"{flag or 'stop strings'}: {_show(ours)} here, "
                         f"{_show(theirs[field])} in the run ({key})")
    samples = run.config.learner.eval_samples
    if samples > 1:
        lines.append(f"samples a question: 1 here, {samples} in the run (learner.eval_samples; "
                     f"its eval/em is the mean of {samples})")
    try:
        test_files = run.test_files()
    except RunError:
        test_files = list(run.config.data.test_files)
    data = list(data)
    if len(data) != len(test_files) or not all(
            _same_path(a, b) for a, b in zip(data, test_files, strict=False)):
        lines.append(f"--data: {_show(data)} here, {_show(test_files)} in the run "
                     "(data.test_files)")
    elif not run_questions or limit is not None:
        first = run.config.data.max_test_items
        cap = run.config.learner.eval_max_questions
        ours = f"the first {limit} of each data source" if limit is not None else "every row"
        if run_questions:
            ours += " of the run's"
        theirs = "every row" if first is None else f"the first {first} rows"
        lines.append(f"questions: {ours} here, {theirs}, at most {cap} of them, in the run "
                     "(data.max_test_items, learner.eval_max_questions)")
    try:
        run_index = run.index_dir()
    except RunError:
        run_index = run.config.retriever.index_dir or None
    if retriever_url is None and index is not None and not _same_path(index, run_index):
        lines.append(f"--index: {index} here, {run_index} in the run (retriever.index_dir)")
    rollout = run.config.rollout
    if engine != rollout.engine:
        lines.append(f"--engine: {engine} here, {rollout.engine} in the run (rollout.engine)")
    if device != rollout.device and engine != "vllm":
        lines.append(f"--device: {device} here, {rollout.device} in the run (rollout.device)")
    if not _same_dtype(dtype, rollout.dtype, device):
        lines.append(f"--dtype: {dtype} here, {rollout.dtype} in the run (rollout.dtype)")
    if retriever_url is None and query_dtype != run.config.retriever.query_dtype:
        lines.append(f"--query-dtype: {query_dtype} here, {run.config.retriever.query_dtype} "
                     "in the run (retriever.query_dtype)")
    run_search = run.search_params()
    if retriever_url is None and search_params != run_search:
        for key in SEARCH_KEYS:
            if search_params.get(key) != run_search.get(key):
                lines.append(f"retriever.{key}: {search_params.get(key, 'the index default')} "
                             f"here, {run_search.get(key, 'the index default')} in the run "
                             "(forage eval --run takes it)")
    return lines
