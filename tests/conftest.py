"""Shared pytest fixtures live in plugin modules, one per concern."""

pytest_plugins = ["tests.databases"]
