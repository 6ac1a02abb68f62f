"""Helpers for testing padless itself on machines without the hardware its fast paths need."""
