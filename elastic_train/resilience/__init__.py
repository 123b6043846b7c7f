"""Surviving the real world: preemption signals, hung steps, goodput accounting."""
