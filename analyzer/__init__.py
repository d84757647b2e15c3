"""Trace-log analyzer: loads every supported format into one table and localizes hung and slow ranks."""
