"""Shared pytest fixtures live in plugin modules, one per concern.

Property tests are derandomized: CI runs the same examples every time, so a red run is a
regression and not a new random draw. Explore with fresh random examples locally with
`pytest --hypothesis-profile=explore` (and keep what it finds as an explicit test).
"""

from hypothesis import settings

settings.register_profile("cpn", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("cpn")

pytest_plugins = ["tests.databases"]
