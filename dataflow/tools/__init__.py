"""Read-side tools over a recorded run: inspect, export, garbage collection."""
