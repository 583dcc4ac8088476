"""Test configuration: files under tests/ranks run only inside a multi-rank launch (see harness.py)."""
import os

if not os.environ.get("HPCTRAIN_INNER_PYTEST"):
    collect_ignore_glob = ["ranks/*"]
