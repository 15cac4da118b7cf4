"""Timing harness: fresh-process cells, campaigns in blocks, paired statistics."""
