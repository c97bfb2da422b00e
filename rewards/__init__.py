"""The built-in tasks, one file each: data, prompt, and reward functions with worked examples."""

from rewards import addition, countdown

TASKS = {task.name: task for task in (addition.TASK, countdown.TASK)}
