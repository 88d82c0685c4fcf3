"""``python -m conversion ...`` (and the ``megarl-convert`` console script)."""

import sys

from conversion.cli import main

__all__ = ["main"]

if __name__ == "__main__":  # also keeps dist_checkpointing's spawned writer from re-running it
    sys.exit(main())
