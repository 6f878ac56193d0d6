"""Tests of the built-in plugins in plugins/."""
