"""Make every notebooks/*.ipynb name the kvlab kernel (metadata.kernelspec), changing nothing else.

Edits the JSON text directly rather than round-tripping through nbformat, so cell ids,
outputs, key order and indentation stay byte-for-byte as they were. Run from anywhere:

    .venv/bin/python scripts/set-kernelspec.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvlab.atomic import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
# In the key order nbformat writes (sorted), so the diff is the three values only.
KERNELSPEC = {"display_name": "Python (kvlab)", "language": "python", "name": "kvlab"}


def set_kernelspec(path: Path) -> bool:
    """Set ``metadata.kernelspec`` of one notebook; return whether the file changed."""
    text = path.read_text()
    nb = json.loads(text)
    if nb.get("metadata", {}).get("kernelspec") == KERNELSPEC:
        return False
    nb.setdefault("metadata", {})["kernelspec"] = KERNELSPEC
    # Jupyter writes notebooks with indent=1, ensure_ascii=False and a final newline.
    new = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    atomic_write_text(path, new, mode=path.stat().st_mode & 0o777)  # keep the notebook's own mode
    return True


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for p in paths:
        print(f"{p.name}: {'set' if set_kernelspec(p) else 'already kvlab'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
