"""What every part of the GPU check shares: model shapes, FLOP counts, device facts, JSON output.

The shapes are the published Qwen2.5 configs (hidden size, layers, heads, vocabulary) with
random weights: step time and memory depend on the shape, not on the values, and no model hub
can be reached on the GPU machine. `--dry-run` swaps every shape for a toy one of the same
architecture, so the same code paths run on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Qwen2.5-0.5B / 1.5B / 3B (their config.json; 3B is the Search-R1 recipe's model), and a toy
# of the same architecture for --dry-run.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True, rope_theta=1000000.0,
                         max_position_embeddings=32768),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True, rope_theta=1000000.0,
                         max_position_embeddings=32768),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                       tie_word_embeddings=True, rope_theta=1000000.0,
                       max_position_embeddings=32768),
    "toy": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=4096),
}

# Dense bf16 tensor-core peak from NVIDIA's datasheets (SXM parts), FLOP/s. MFU is reported
# against this; the matrix-product figure each run measures is recorded beside it.
DATASHEET_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}


def qwen2_config(shape: str):
    from transformers import Qwen2Config

    return Qwen2Config(**SHAPES[shape], bos_token_id=1, eos_token_id=2, pad_token_id=0)


def parameter_count(shape: str) -> dict[str, int]:
    """Parameters of a Qwen2 shape: total (tied embedding counted once) and those a matrix
    product touches per token (every decoder weight plus the LM head's hidden x vocab)."""
    s = SHAPES[shape]
    h, f, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    head_dim = h // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * head_dim
    attention = h * h + h + 2 * (h * kv + kv) + h * h  # q (bias), k, v (bias), o
    mlp = 3 * h * f
    layer = attention + mlp + 2 * h  # two RMSNorms
    embedding = s["vocab_size"] * h
    body = layers * layer + h  # final norm
    head = 0 if s["tie_word_embeddings"] else embedding
    return {"total": body + embedding + head, "matmul": body + embedding}


def train_flops(shape: str, lengths: list[int]) -> float:
    """Model FLOPs of one training step (forward + backward = 3 x forward) over sequences of
    `lengths`: 2 x matmul parameters per token, plus causal attention (QK^T and AV, each
    2 x hidden per pair of positions, over L(L+1)/2 pairs per layer). Recomputation under
    gradient checkpointing is not counted (the usual MFU convention)."""
    s = SHAPES[shape]
    per_token = 2 * parameter_count(shape)["matmul"]
    attention = sum(4 * s["hidden_size"] * n * (n + 1) / 2 for n in lengths)
    forward = per_token * sum(lengths) + attention * s["num_hidden_layers"]
    return 3.0 * forward


def datasheet_peak(device_name: str) -> float | None:
    for key, flops in DATASHEET_BF16_FLOPS.items():
        if key in device_name:
            return flops
    return None


def device_facts() -> dict[str, Any]:
    """Where the figures came from: device, driver, library versions."""
    import torch

    facts: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda, "cpu_count": os.cpu_count(),
        "host": platform.node(),
    }
    for module in ("transformers", "deepspeed", "faiss", "grpc", "sentence_transformers"):
        try:
            facts[module] = __import__(module).__version__
        except Exception as exc:  # a part reports its own import error; this is a summary
            facts[module] = f"unavailable: {type(exc).__name__}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(device=torch.cuda.get_device_name(0), device_type="cuda",
                     gpu_memory_gib=round(props.total_memory / 2**30, 1),
                     multiprocessors=props.multi_processor_count,
                     capability=f"{props.major}.{props.minor}")
        smi = shutil.which("nvidia-smi")
        if smi:
            import subprocess

            query = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=30)
            facts["driver"] = query.stdout.strip() or None
    else:
        facts.update(device=f"CPU ({platform.processor() or platform.machine()})",
                     device_type="cpu")
    return facts


def torch_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_memory_gib() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def reset_peak_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomic write: a part killed at its time limit leaves its last complete file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


class PartReport:
    """One part's JSON file, rewritten after every measurement it adds."""

    def __init__(self, out: Path, part: str, dry_run: bool) -> None:
        self.path = out / f"{part}.json"
        self.data: dict[str, Any] = {"part": part, "dry_run": dry_run, "ok": False,
                                     "error": None, "started": time.time(), "results": [],
                                     "notes": []}
        self.save()

    def add(self, result: dict[str, Any]) -> None:
        self.data["results"].append(result)
        self.save()

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self.save()

    def set(self, **values: Any) -> None:
        self.data.update(values)
        self.save()

    def stage(self, text: str) -> None:
        """What the part is doing now, saved at once: a part stopped at its time limit is
        reported with the stage it was in (run.py)."""
        self.data["stage"] = text
        self.data["stage_at_s"] = round(time.time() - self.data["started"], 1)
        self.save()

    def finish(self) -> None:
        self.data["ok"] = self.data["error"] is None
        self.data["wall_s"] = round(time.time() - self.data["started"], 1)
        self.save()

    def save(self) -> None:
        write_json(self.path, self.data)


def say(text: str) -> None:
    print(text, flush=True)


def _raise_on_signal(signum, frame) -> None:
    raise SystemExit(f"stopped by signal {signum}")


def exit_on_sigterm() -> None:
    """A SIGTERM (run.py's stop at the part's time limit) raises SystemExit, so the part's
    `finally` blocks still write its report and stop its child."""
    signal.signal(signal.SIGTERM, _raise_on_signal)


class ChildConsole:
    """A part's child command (`forage demo`, bench/real_learn.py) whose console goes through
    as it comes (to run.log under run.py) and whose last `keep` lines, time-stamped, go into
    the report. With `exit_on_sigterm()`, the caller's `finally` writes the report and
    `stop()` ends the child when the part is stopped at its time limit."""

    def __init__(self, argv: list[str], keep: int, line_chars: int = 400) -> None:
        self.started = time.perf_counter()
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self.line_chars = line_chars
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)

    def follow(self) -> int:
        """Echo and keep the console until the child exits; its exit code."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            print(line, end="", flush=True)
            self.lines.append(f"{self.elapsed():6.1f}s {line.rstrip()[: self.line_chars]}")
        return self.proc.wait()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def tail(self, lines: int | None = None) -> list[str]:
        kept = list(self.lines)
        return kept if lines is None else kept[-lines:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()


def part_main(part: str, doc: str | None, measure: Callable[[argparse.Namespace, PartReport], None],
              argv: list[str] | None = None,
              add_arguments: Callable[[argparse.ArgumentParser], None] | None = None) -> int:
    """What every part's command does around its measurements: `--out DIR [--dry-run]`, a
    PartReport named after the device, and any exception (a stop at the time limit too)
    recorded in the report before it propagates."""
    parser = argparse.ArgumentParser(description=(doc or part).split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    report = PartReport(args.out, part, args.dry_run)
    try:
        report.set(device=device_facts().get("device"))
        measure(args, report)
    except BaseException as exc:  # SystemExit at the time limit too: say so in the report
        report.set(error=f"{type(exc).__name__}: {exc}"[:4000])
        raise
    finally:
        report.finish()
    return 0
