"""pytest options for the benchmarks (not collected by the unit tests, which live in tests/)."""

from __future__ import annotations


def pytest_addoption(parser):
    parser.addoption("--suite", default="quickstart", help="workload suite to benchmark")
    parser.addoption("--bench-dtype", default=None, help="comma-separated dtypes to keep")
    parser.addoption("--bench-device", default="auto")
    parser.addoption("--bench-limit", type=int, default=None, help="first N cases only")
