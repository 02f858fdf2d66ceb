"""The ground layer: errors, axis names, hashing and file helpers that every other package may import.

It imports nothing of the project's own, so anything can depend on it without a cycle.
"""
