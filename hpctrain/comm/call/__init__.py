"""The call path every collective takes: plan, call check across ranks, run, handles (see ARCHITECTURE.md)."""
