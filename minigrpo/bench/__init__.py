"""`minigrpo bench`: measurements that print figures, side by side in one run (these machines are noisy).

steps.py: the same training step under a few variants, dtypes, memory, per model; trl.py: the step beside TRL's
GRPOTrainer; decode.py: the host's cost of a new token; profile.py: one step's time by phase beside each phase's
floor; learn.py: result cards, held-out accuracy over seeds.
"""
