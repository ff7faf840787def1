"""Native writes to fd 2 go to a file; Python's stderr, logging and tracebacks stay on the terminal."""
import subprocess
import sys

import pytest

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


@pytest.mark.integration  # starts a process or opens a socket (the unit tier's guard)
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


ROUTED = r"""
import logging, sys
from core.logs import NativeStderr
with NativeStderr(sys.argv[1]) as ns:
    # A library imported after start (as Ray is) gives its handler the stream sys.stderr is then: the terminal.
    ray_log = logging.getLogger("ray.some.module")
    ray_log.addHandler(logging.StreamHandler(sys.stderr))
    ray_log.propagate = False
    ns.route(("ray",))
    ray_log.warning("ray: node lost, retrying")
    logging.getLogger("other").addHandler(logging.StreamHandler(sys.stderr))
    logging.getLogger("other").warning("other: stays on the terminal")
"""


@pytest.mark.integration  # starts a process or opens a socket (the unit tier's guard)
def test_a_library_s_python_lines_follow_its_native_ones_to_the_file(tmp_path):
    """Issue 50: after a node loss Ray's lines (44) came to the driver's terminal; the file stayed empty."""
    log = tmp_path / "driver.log"
    r = subprocess.run([sys.executable, "-c", ROUTED, str(log)], capture_output=True, text=True, timeout=60,
                       cwd=__file__.rsplit("/tests/", 1)[0])
    assert r.returncode == 0, r.stderr
    assert "ray: node lost" not in r.stderr and "other: stays on the terminal" in r.stderr
    assert "ray: node lost" in log.read_text()


@pytest.mark.integration  # starts a process or opens a socket (the unit tier's guard)
def test_a_run_with_nothing_to_say_leaves_no_file(tmp_path):
    log = tmp_path / "quiet.log"
    r = subprocess.run([sys.executable, "-c", "import sys\nfrom core.logs import NativeStderr\n"
                        "with NativeStderr(sys.argv[1]):\n    pass\n", str(log)], capture_output=True, text=True,
                       timeout=60, cwd=__file__.rsplit("/tests/", 1)[0])
    assert r.returncode == 0, r.stderr
    assert not log.exists()
