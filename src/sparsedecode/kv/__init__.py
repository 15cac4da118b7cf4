"""KV branch: selectors (SnapKV-style scored selection, sink+recent window) and the compact buffer."""
