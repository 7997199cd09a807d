"""The benchmark scripts are plain files beside `harness.py`, not a package: their folder goes on `sys.path` once, so
the tests here import them by name (as the scripts import `harness` themselves)."""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks")))
