"""Helpers shared by test modules (no test module imports another); tests/ is on sys.path, so `helpers.x`."""
