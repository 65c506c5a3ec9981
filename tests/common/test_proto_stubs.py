"""The committed gRPC stubs match the .proto files (regenerated with proto_build)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from services.common import proto_build

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_are_fresh():
    result = subprocess.run(
        [sys.executable, "-m", "services.common.proto_build", "--check"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_check_notices_a_changed_proto(tmp_path):
    protos = tmp_path / "proto"
    shutil.copytree(proto_build.PROTO_DIR, protos)
    out = tmp_path / "gen"
    proto_build.generate(out, protos)
    assert proto_build.check(out, protos) == []
    source = protos / "forage" / "weight_sync.proto"
    source.write_text(source.read_text() + "\nmessage Extra { string note = 1; }\n")
    problems = proto_build.check(out, protos)
    assert problems and "weight_sync_pb2.py" in problems[0]


def test_stub_imports_point_at_the_package():
    text = (proto_build.OUT_DIR / "forage" / "weight_sync_pb2_grpc.py").read_text()
    assert "from services.common.proto_gen.forage import weight_sync_pb2" in text
    from services.common.proto_gen.forage import weight_sync_pb2_grpc

    assert hasattr(weight_sync_pb2_grpc, "WeightSyncStub")
