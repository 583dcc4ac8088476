"""What the launcher relays of an elastic mpirun's output: text, and no warning a user cannot act on.

Under Open MPI's fault-tolerance extension (``--with-ft ulfm``) every
selection of the shared-memory window component prints a boxed warning that
it "is not tested for post-failure operation", and later "N more processes
have sent help message ..." lines; each box ends with a NUL byte.  hpctrain
uses those windows only within one world: a re-formed world makes new ones and
never touches a window across a failure.  :class:`Relay` drops the boxes and
their reminders, says once in one line what they meant, and strips NUL bytes,
so the relayed output is text.  Every other line passes unchanged, in order.
Cost: one scan of each line; a box (at most :data:`MAX_BOX` lines) is held
until its closing rule.
"""
from __future__ import annotations

import re
from typing import Callable, Optional

__all__ = ["Relay", "OSC_NOTE"]

MAX_BOX = 24            # lines a box may have before it is passed on as it is
_RULE = re.compile(rb"^-{20,}\s*$")
_UNTESTED = b"is not tested for post-failure"
_REMINDERS = (re.compile(rb"\d+ more process(es)? ha(s|ve) sent help message help-osc"),
              re.compile(rb"Set MCA parameter \"?\w*base_help_aggregate\"? to 0"))
OSC_NOTE = (b"hpctrain launch: note: Open MPI warns that its shared-memory window component (osc/sm) is not tested "
            b"after failures; hpctrain uses its windows within one world only (a re-formed world makes new ones), "
            b"so that warning is left out\n")


class Relay:
    """Pass lines of one stream to ``write``, leaving out Open MPI's untested-after-failure boxes (module docstring).

    Feed it with :meth:`line` for each line read, then :meth:`close` at the end of the stream; ``said`` (a set
    shared by the relays of one launch's streams) makes the note once per launch.
    """

    def __init__(self, write: Callable[[bytes], None], said: Optional[set] = None):
        self.write, self.box = write, None          # (box: the lines of a box being read, or None)
        self.said = said if said is not None else set()     # (shared by the streams of one launch: said once)

    def line(self, raw: bytes) -> None:
        """Take one line (with its newline) of the stream."""
        line = raw.replace(b"\x00", b"")
        if not line:
            return
        if self.box is not None:
            self.box.append(line)
            if _RULE.match(line) and len(self.box) > 1:
                self._end_box()
            elif len(self.box) >= MAX_BOX:
                self._flush_box()
            return
        if _RULE.match(line):
            self.box = [line]
        elif not any(r.search(line) for r in _REMINDERS):
            self.write(line)

    def close(self) -> None:
        """The stream ended: pass on what a box still held."""
        self._flush_box()

    def _end_box(self) -> None:
        if any(_UNTESTED in line for line in self.box):
            self.box = None
            if OSC_NOTE not in self.said:
                self.said.add(OSC_NOTE)
                self.write(OSC_NOTE)
        else:
            self._flush_box()

    def _flush_box(self) -> None:
        box, self.box = self.box, None
        for line in box or []:
            self.write(line)
