"""An example out-of-tree Flint pass package (see docs/writing-passes.md)."""
