import json
import subprocess
import sys


def test_info_prints_version_and_cuda_availability() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hicache.cli", "info"], check=True, capture_output=True, text=True
    )
    info = json.loads(out.stdout)
    assert info["version"] and isinstance(info["cuda_available"], bool)


def test_unknown_command_is_a_usage_error() -> None:
    out = subprocess.run([sys.executable, "-m", "hicache.cli", "frobnicate"], capture_output=True, text=True)
    assert out.returncode == 2 and "invalid choice" in out.stderr
