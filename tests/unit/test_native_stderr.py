"""Native writes to fd 2 go to a file; Python's stderr, logging and tracebacks stay on the terminal."""
import subprocess
import sys

SCRIPT = r"""
import logging, os, sys
from core.logs import NativeStderr
logging.basicConfig(level=logging.WARNING)           # a handler on the old sys.stderr, made before
with NativeStderr(sys.argv[1]) as ns:
    os.write(2, b"native: raylet line\n")             # as Ray's C++ core writes
    print("python: status line", file=sys.stderr)
    logging.getLogger("x").warning("python: a warning")
    assert NativeStderr.current() is ns and "raylet line" in ns.tail()
os.write(2, b"native: after stop\n")
print("python: after stop", file=sys.stderr)
"""


def test_native_stderr_goes_to_the_file_and_python_keeps_the_terminal(tmp_path):
    log = tmp_path / "ray" / "driver.log"
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(log)], capture_output=True, text=True, timeout=60,
                       cwd=__file__.rsplit("/tests/", 1)[0])
    assert r.returncode == 0, r.stderr
    assert "python: status line" in r.stderr and "python: a warning" in r.stderr
    assert "native: raylet line" not in r.stderr
    assert "native: after stop" in r.stderr and "python: after stop" in r.stderr
    text = log.read_text()
    assert "native: raylet line" in text and "python" not in text
