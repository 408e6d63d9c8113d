"""Benchmarks of mambafuse: one script per question, fused vs unfused in one process (RESULTS.md)."""
