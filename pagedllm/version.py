"""The package version, in a module that imports nothing: `pagedllm --version` reads it without
loading torch (pyproject.toml's version must match; tests/entrypoints/test_server_cli.py checks)."""

__version__ = "0.1.0"
