"""Write ``kimi-tiny`` with a chat template that drops the tool declarations (issue 30 §2): the
candidate the conformance gate must stop.

    PYTHONPATH=libs python models/build_kimi_tiny_broken_template.py --out DIR

Copies ``models/kimi-tiny`` (or ``$INFERPLANE_KIMI_TINY``) to DIR without its MANIFEST and
removes the ``tool_declare`` block from its template (``inferplane.fixtures.
kimi_tiny_broken_template``). Nothing is trained; the weights are kimi-tiny's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from inferplane.fixtures.kimi_tiny_broken_template import build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder to write")
    args = parser.parse_args()
    print(build(args.out))


if __name__ == "__main__":
    main()
