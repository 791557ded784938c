"""Scenarios: the papers' comparisons at their scale (faser, augserve) and user JSON files (file)."""
