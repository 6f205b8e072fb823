"""The 3D-parallel training runtime (resource layer): what workers run.

`model.py` the GPT, `parallelize.py` its tensor-parallel shards, `pipeline.py` the
schedules, `dp.py` data-parallel sync, `trainer.py` one worker's loop, `launch.py` all
workers of a plan on this machine.
"""
