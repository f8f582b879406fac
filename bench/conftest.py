"""Collects `bench_*.py` files as pytest modules (run: `pytest bench --benchmark-only`)."""

from __future__ import annotations

import pytest


def pytest_collect_file(file_path, parent):
    # Files named on the command line are collected by pytest itself; don't collect them twice.
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") \
            and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
