"""The decode loop: chunked prefill, captured decode step, sampling and generation."""
