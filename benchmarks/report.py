"""Re-render a saved run: ``python benchmarks/report.py benchmarks/results/bench.json
[--out DIR | --readme]`` (``runtime.bench.suite.rerender``)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime.bench.suite import rerender as main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
