import json
import subprocess
import sys


def test_demo_runs_and_reports_identical_pages() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hicache.cli", "demo", "--json", "--conversations", "3", "--turns", "3"],
        check=True,
        capture_output=True,
        text=True,
    )
    result = json.loads(out.stdout)
    assert result["mismatched_pages"] == 0
    assert result["requests"] == 9
    assert result["tokens_from_cache"] > 0


def test_info_prints_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hicache.cli", "info"], check=True, capture_output=True, text=True
    )
    assert json.loads(out.stdout)["version"]
