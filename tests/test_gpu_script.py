"""The committed GPU script's own checks, on CPU (its stages run in ``gpu_run.py run --rehearse``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_run.py"


def test_setup_names_wheels_built_for_another_python_instead_of_failing_in_pip(tmp_path):
    """A rehearsal beside the folder ``prepare`` filled for the GPU machine's Python 3.12 ended in pip's
    traceback; setup names the wheels and the Python, and installs nothing."""
    other = "cp39" if sys.version_info[:2] != (3, 9) else "cp310"
    (tmp_path / f"orjson-3.13.0-{other}-{other}-manylinux_2_17_x86_64.whl").write_bytes(b"")
    (tmp_path / "gitpython-3.2.1-py3-none-any.whl").write_bytes(b"")  # pure Python: any interpreter's
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "setup", "--wheels", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"orjson-3.13.0-{other}" in done.stderr and "another Python" in done.stderr, done.stderr
    assert "gitpython" not in done.stderr and "Traceback" not in done.stderr
