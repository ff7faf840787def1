"""`python -m stragglerscope` is the `stragglerscope` command."""
import sys

from stragglerscope.cli import main

sys.exit(main())
