"""Agents written the way users write theirs, for tests/test_testing_harness.py."""
