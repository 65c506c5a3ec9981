"""`forage doctor [--json]`: can this node run Forage? Versions and their incompatibilities.

One line per component (OS and Python, NVIDIA driver, GPUs, torch and its CUDA build, vLLM,
faiss, NCCL, flash-attn, DeepSpeed, transformers), then one line per finding, then a summary.
Exit code 0 when nothing is wrong (warnings allowed), 1 when something is. The rules are in
services/common/doctor.py, the probing in services/common/doctor_probe.py.
"""

from __future__ import annotations

import argparse
import json


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print the versions and findings as one JSON object")
    parser.set_defaults(handler=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    from services.common.doctor import as_json, check, exit_code, render
    from services.common.doctor_probe import probe

    versions = probe()
    findings = check(versions)
    if args.json:
        print(json.dumps(as_json(versions, findings), indent=2))
    else:
        print(render(versions, findings))
    return exit_code(findings)
