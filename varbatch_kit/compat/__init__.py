"""Compatibility layers that reproduce other frameworks' exact signatures."""
