"""``python -m fusion.olive CONFIG``: the same as ``mambafuse olive CONFIG`` (fusion/olive_command.py), which
checks its arguments before importing Olive and then this package, registering the surgeon."""

import sys

from fusion import olive_command

sys.exit(olive_command.main(prog="python -m fusion.olive"))
