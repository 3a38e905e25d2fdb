"""Tooling of this repository, not installed with the package: it reads and writes the clone's own files.

``python -m tools.tables`` renders every table block of README.md and docs/*.md from results/.
"""
