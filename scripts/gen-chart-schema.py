#!/usr/bin/env python3
"""Write the `config` part of deploy/helm/mpsd/values.schema.json from mpsd's own settings
(mpsd/config/settings.py: SETTINGS and what each parser accepts; mpsd/config/schema.py makes the
schema). The rest of the file is hand-written and kept byte for byte. ``--check`` writes nothing
and exits 1 when the committed file differs from what this script would write
(tests/deploy/test_chart_schema.py runs it).

    python scripts/gen-chart-schema.py            # after adding or changing a setting
    python scripts/gen-chart-schema.py --check
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / "deploy" / "helm" / "mpsd" / "values.schema.json"
sys.path.insert(0, str(REPO))  # this tree's mpsd, installed or not

from mpsd.config.schema import with_config  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is out of date; write nothing")
    parser.add_argument("--schema", type=Path, default=SCHEMA, help="the chart's values.schema.json")
    args = parser.parse_args()
    old = args.schema.read_text()
    new = with_config(old)
    if args.check:
        if new != old:
            print(f"{args.schema}: its config part differs from mpsd's settings; run scripts/gen-chart-schema.py",
                  file=sys.stderr)
            return 1
        return 0
    if new != old:
        args.schema.write_text(new)
        print(f"wrote {args.schema}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
