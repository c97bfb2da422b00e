"""The built-in tasks, one file each: data, prompt, and reward functions with worked examples.

`format` and `length` hold rewards to add beside a task's own (`--reward rewards.format:format_reward`).
"""

from rewards import addition, code, countdown, gsm8k, maths

TASKS = {task.name: task for task in (addition.TASK, countdown.TASK, gsm8k.TASK, maths.TASK, code.TASK)}
