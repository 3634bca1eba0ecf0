"""The state machine's Lua scripts, one named file each under ``lua/`` (read once)."""

from __future__ import annotations

from functools import cache
from importlib import resources

#: A script whose first line is ``-- uses: NAME …`` gets those shared pieces (``lua/NAME.lua``, local functions)
#: put before its text, so one piece of Lua serves several scripts.
USES = "-- uses:"


@cache
def lua(name: str) -> str:
    """The text of ``thinkfleet/state/lua/{name}.lua``, after the shared pieces its first line names."""
    text = resources.files("thinkfleet.state").joinpath("lua", f"{name}.lua").read_text()
    first = text.split("\n", 1)[0]
    if not first.startswith(USES):
        return text
    return "\n".join([*(lua(piece) for piece in first[len(USES) :].split()), text])
