"""``python -m demo``: see :mod:`demo.app`."""

from demo.app import main

main()
