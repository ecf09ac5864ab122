"""The lower end of the tested transformers range: the same as `python tests/helpers/version_ends.py
transformers-oldest [pytest arguments]` (version_ends.py builds the venv and names the tests), kept for the command
the docs give."""

from __future__ import annotations

import sys

from version_ends import main

if __name__ == "__main__":
    raise SystemExit(main(["transformers-oldest", *sys.argv[1:]]))
