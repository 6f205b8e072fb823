"""cpn: a scheduler for a computing power network.

GPU clusters in several datacenters, joined by slow WAN links, run as one pool for
training large models. See README.md for the layers (ITU-T Y.2501) and where each lives.
"""

__version__ = "0.1.0"
