"""Fakes of external services for the tests; each speaks the real wire protocol."""
