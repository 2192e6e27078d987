"""bench/results/ as a reader finds it: one current run per profile at the top, every earlier run indexed in
history/README.md, and every results path the bench's README names still there."""

from __future__ import annotations

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
RESULTS = BENCH / "results"
HISTORY = RESULTS / "history"


def test_every_earlier_run_is_in_the_history_index_and_every_index_link_resolves() -> None:
    index = (HISTORY / "README.md").read_text()
    links = re.findall(r"\]\(([^)]+)\)", index)
    assert links, "the history index links no run"
    for link in links:
        assert (HISTORY / link).is_dir(), f"history/README.md links {link}, which is not there"
    runs = {f"{p.parent.name}/{p.name}" for p in HISTORY.glob("*/*") if p.is_dir()}
    unindexed = sorted(r for r in runs if f"({r}/)" not in index)
    assert not unindexed, f"not in history/README.md: {unindexed}"


def test_the_top_holds_one_run_per_profile_not_per_commit_folders() -> None:
    for profile in ("cpu", "gpu"):
        assert (RESULTS / profile / "results.json").is_file()
        per_commit = sorted(p.name for p in (RESULTS / profile).iterdir() if re.search(r"-[0-9a-f]{7}\b", p.name))
        assert not per_commit, f"{profile}/ holds earlier runs (move them to history/): {per_commit}"


def test_every_results_path_the_bench_readme_names_exists() -> None:
    readme = (BENCH / "README.md").read_text()
    paths = set(re.findall(r"`(?:bench/)?(results/[^`\s]*?)/?`", readme))
    assert "results/history/findings.md" in paths
    missing = sorted(p for p in paths if "*" not in p and not (BENCH / p).exists())
    assert not missing, f"bench/README.md names paths that are not there: {missing}"
