"""Generated gRPC stubs; see services/common/proto_build.py."""
