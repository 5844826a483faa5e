"""Write the JSON Schemas of the manifest format into schema/ (after changing casnap/format/).

.venv/bin/python tools/export_schema.py          # rewrite schema/*.json
.venv/bin/python tools/export_schema.py --check  # exit 1 if the files drifted
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from casnap.format.parse import json_schemas

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schema"


def rendered() -> dict[str, str]:
    return {
        name: json.dumps(s, indent=2, sort_keys=True) + "\n" for name, s in json_schemas().items()
    }


def main(argv: list[str]) -> int:
    drift = []
    for name, text in rendered().items():
        path = SCHEMA_DIR / name
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                drift.append(name)
        else:
            SCHEMA_DIR.mkdir(exist_ok=True)
            path.write_text(text)
    if drift:
        print(
            f"schema files drifted from casnap/format/: {', '.join(drift)}; "
            "run tools/export_schema.py",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
