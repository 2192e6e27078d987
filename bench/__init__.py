"""mlxsup benchmark suite (issue 7) and eviction benchmark (issue 3). Run: python -m bench --help."""
