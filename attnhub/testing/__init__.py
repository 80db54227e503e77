"""Conformance kit (filled below)."""
