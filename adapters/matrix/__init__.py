"""Matrix over matrix-nio: see `adapters.matrix.adapter`."""

from adapters.matrix.adapter import MatrixAdapter

__all__ = ["MatrixAdapter"]
