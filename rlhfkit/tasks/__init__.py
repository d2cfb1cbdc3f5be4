"""Built-in tasks with their gold judges (the tiny toy task here; the offline demo task later)."""
