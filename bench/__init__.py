"""mlxsup benchmark suite: which question each command answers is bench/QUESTIONS.md. Run: python -m bench --help."""
