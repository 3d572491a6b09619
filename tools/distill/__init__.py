"""Distilling the default draft model from the default target (see train.py)."""
