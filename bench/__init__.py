"""Workload generator and benchmark suites."""
