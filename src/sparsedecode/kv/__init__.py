"""KV branch: selectors (SnapKV-style scored selection, sink+recent window) and the compact buffer.

ByteCross §4.1 and App. A 'Scored selection'. Selectors are found by name in
`SELECTORS` (kv/select.py); `get_selector(name, **fields)` builds one.
"""

from sparsedecode.kv.select import SELECTORS, KVSelector, get_selector

__all__ = ["SELECTORS", "KVSelector", "get_selector"]
