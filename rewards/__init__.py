"""The built-in tasks, one file each: data, prompt, and reward functions with worked examples
(`minigrpo.tasks.BUILT_IN` names them).

`format` and `length` hold rewards to add beside a task's own (`--reward rewards.format:format_reward`).
"""
