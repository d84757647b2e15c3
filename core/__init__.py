"""Megatrace: find the hung or slow rank of a distributed training job and tell the people on call."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("megatrace")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
