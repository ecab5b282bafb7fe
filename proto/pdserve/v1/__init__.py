"""pdserve v1 public API and internal KV-transfer protos (generated *_pb2 modules)."""
