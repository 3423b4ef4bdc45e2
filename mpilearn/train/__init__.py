"""Training: tasks (what a model builder returns) and the data-parallel engine."""
from .tasks import SupervisedTask, Task

__all__ = ["SupervisedTask", "Task"]
