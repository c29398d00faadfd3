"""Discrete-event simulation of serving instances on a simulated clock."""

from kvbalance.sim.loop import EventLoop, InstanceDriver, SimRun, simulate_instance

__all__ = ["EventLoop", "InstanceDriver", "SimRun", "simulate_instance"]
