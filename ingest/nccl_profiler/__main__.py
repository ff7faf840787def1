"""``python -m ingest.nccl_profiler [--force]``: build the plugin's library and print its path (set-up runs it)."""
import sys

from ingest.nccl_profiler import BuildError, build

try:
    print(build(force="--force" in sys.argv[1:]))
except BuildError as e:
    print(f"nccl profiler plugin: {e}", file=sys.stderr)
    sys.exit(1)
