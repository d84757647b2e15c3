"""The table of trace formats the analyzer reads; adding a format is adding its module and one line here.

Formats are told apart by their first bytes (each reader's `detect`, tried in this order), never by
file name.
"""

from __future__ import annotations

from megatrace.analyzer.flight_recorder import READER as FLIGHT_RECORDER
from megatrace.analyzer.nccl_comms import READER as NCCL_LOG
from megatrace.analyzer.reader_api import Reader
from megatrace.analyzer.tracer_formats import DUMP, RING

READERS: dict[str, Reader] = {reader.name: reader for reader in (RING, DUMP, NCCL_LOG, FLIGHT_RECORDER)}


def detect(head: bytes) -> Reader | None:
    """The reader of a file that starts with `head`, or None for an unknown format."""
    return next((reader for reader in READERS.values() if reader.detect(head)), None)
