"""Collective tracer: records every collective a rank issues into a memory-mapped ring buffer."""
