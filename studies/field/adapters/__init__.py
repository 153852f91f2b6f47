"""Thin adapters: each wraps one call of a real package in kvlab's audit contract and fixes nothing.

An adapter's module imports its package at import time, so it loads only in that package's
environment (studies/field_audit.py builds one per package and release).
"""
