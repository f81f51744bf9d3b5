"""The ``terarec`` program exits without interpreter teardown, yet keeps what exit
handlers and buffered output owe the user."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _program(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def test_exit_runs_handlers_flushes_output_and_keeps_the_code(tmp_path: Path) -> None:
    marker = tmp_path / "handler-ran"
    done = _program(
        "import atexit, sys\n"
        "import terarec.cli.main as m\n"
        f"atexit.register(lambda: open({str(marker)!r}, 'w').write('x'))\n"
        "def fake(argv=None):\n"
        "    sys.stdout.write('buffered line\\n' * 3000)\n"  # more than one buffer
        "    return 3\n"
        "m.main = fake\n"
        "m.run()\n", tmp_path)
    assert done.returncode == 3
    assert done.stdout == "buffered line\n" * 3000
    assert marker.read_text() == "x"


def test_errors_keep_exit_code_two(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run([sys.executable, "-m", "terarec", "train", "--train",
                           str(tmp_path / "missing.txt"), "--out", str(tmp_path / "m")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "missing.txt" in done.stderr
