"""spark-submit entry points: the streaming job and the demo around it."""
