"""Test-wide settings.

Hypothesis runs derandomized by default, so a clean-clone CI run sees the same examples
every time. To explore with fresh random examples:

    HYPOTHESIS_PROFILE=explore .venv/bin/python -m pytest tests/test_store_model.py
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
