"""The way in: the door every request passes (`door`: validation against the served model,
queue limits, per-key concurrency) and API keys (`auth`)."""
