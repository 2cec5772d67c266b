"""The latency suite from a checkout: ``python benchmarks/run.py [options]`` is
``python -m runtime bench [options]`` (the suite lives in ``runtime/bench/suite.py``)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
