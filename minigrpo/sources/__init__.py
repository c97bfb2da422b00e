"""Tasks from libraries: `--task rg:NAME` (reasoning-gym), `--task vf:NAME` (verifiers), `--task openenv:URL`.

Each source turns its library's task into a `Task`'s fields (rows, rewards, tools, an environment) and is imported
only when a spec names it, so none of the libraries is needed to run anything else. spec.py holds what they share:
the options written after the name and the held-out split.
"""
