"""Standalone (no ONNX Runtime) tests of the kernels: golden cases, cross builds, MSL emulation."""
