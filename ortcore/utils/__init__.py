"""Utilities for training loops around ORTModule; ``ortcore.utils.data`` holds the samplers plugins contribute."""
