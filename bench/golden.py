"""Where the reference vectors live: `$VOICERTC_GOLDEN`, else `../shared/golden` beside the checkout.

The variable lets a copy of the checkout without its sibling `shared/` (a lent GPU machine, a container)
point at a carried copy of golden/.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def golden_dir() -> Path:
    return Path(os.environ.get("VOICERTC_GOLDEN") or REPO.parent / "shared" / "golden")


GOLDEN = golden_dir()
