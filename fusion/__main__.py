"""``python -m fusion``: the ``mambafuse`` command (``rewrite``, ``report``, ``--version``)."""

from __future__ import annotations

import sys

from fusion.cli import main

sys.exit(main())
