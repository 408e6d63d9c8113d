"""Small random-weight Nemotron-H / Zamba2 models, their ONNX exports, chain inspection (no hub)."""
