"""The state machine's Lua scripts, one named file each under ``lua/`` (read once)."""

from __future__ import annotations

from functools import cache
from importlib import resources


@cache
def lua(name: str) -> str:
    """The text of ``thinkfleet/state/lua/{name}.lua``."""
    return resources.files("thinkfleet.state").joinpath("lua", f"{name}.lua").read_text()
