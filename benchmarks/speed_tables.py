"""Print the README's timing tables from record files (nothing is measured here).

    PYTHONPATH=src python benchmarks/speed_tables.py RECORD.json [RECORD.json ...]
"""

from __future__ import annotations

import sys

from sparsedecode.report.speed_tables import speed_tables

if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    print(speed_tables(sys.argv[1:]))
