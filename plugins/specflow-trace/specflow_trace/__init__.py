"""specflow-trace: `observer=[trace]` writes a Chrome trace of every stage hook and a time table."""
__version__ = "0.1.0"
