"""Projection branch: thresholds, calibrators (TEAL, CATS, SATS) and token routing."""
