"""Graph side of mambafuse: find gated group-RMSNorm chains in ONNX models and fuse them."""
