"""specflow's version (pyproject.toml carries the same; tests/test_packaging.py checks)."""
__version__ = "0.2.1"
